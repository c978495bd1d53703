"""Evaluation: few-shot, k-NN and linear-probe accuracy of frozen encoders, and the ViT paper's
Figure 7 analyses of what an encoder has learned, with their pictures."""
