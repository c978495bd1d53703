"""What a run leaves behind, apart from training itself: checkpoint files written whole
(checkpoint_io), the W&B run and its records on disk (wandb_run, wandb_records), `mpp predict`'s
files (predictions) and the original | corrupted | predicted | true pictures (prediction_pictures)."""
