"""Training: the Lightning modules (masked patch pretraining, classification) on a thin shared
base; their optimiser and schedule, the run's steps, each step's seeds, the non-finite loss policy,
the prediction pictures, the callbacks that watch a run, checkpoint files, strategies, and the W&B run
with its records read back."""
