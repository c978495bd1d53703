"""Evaluation: few-shot accuracy of frozen encoders, and a W&B run's records read back."""
