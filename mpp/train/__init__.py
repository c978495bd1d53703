"""Training: the Lightning modules (masked patch pretraining, classification) on a thin shared
base, their optimiser and schedule, loss guard, callbacks, pictures, checkpoint files, strategies."""
