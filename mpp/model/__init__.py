"""The model: the ViT encoder, patch corruption, prediction targets, pixel conventions, encoders read
back from checkpoints and exports, and exports written for timm and Hugging Face. Nothing here knows
Lightning."""
