"""The model: the ViT encoder, patch corruption, prediction targets, pixel conventions, and
encoders read back from checkpoints. Nothing here knows Lightning."""
