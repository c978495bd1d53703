"""k-nearest-neighbour accuracy of frozen image representations, weighted as DINO (Caron et al., 2021)
evaluates self-supervised features: no fit at all, so it measures the features' geometry alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mpp.eval.linear import DEFAULTS


def knn_predictions(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    *,
    num_classes: int,
    k: int = DEFAULTS.knn_k,
    temperature: float = DEFAULTS.knn_temperature,
    chunk_size: int = 1024,
) -> Tensor:
    """(N, D), (N,), (M, D) -> (M,) predicted classes. Every feature is L2-normalised; the k training
    features of largest cosine similarity s to a test feature vote for their class with weight
    exp(s / temperature), and the class of the largest summed weight wins (the lowest class of a tie).

    Test features go `chunk_size` at a time, so that the (chunk, N) similarities, not (M, N), are held.
    """
    if k < 1 or temperature <= 0:
        raise ValueError(f"k-NN needs k of at least 1 and a positive temperature, got k={k}, temperature={temperature}")
    train = nn.functional.normalize(train_features.float(), dim=1)  # (N, D)
    labels = train_labels.long().to(train.device)
    k = min(k, len(train))
    predictions = []
    for chunk in test_features.split(chunk_size):
        similarity = nn.functional.normalize(chunk.float().to(train.device), dim=1) @ train.T  # (m, N)
        nearest, index = similarity.topk(k, dim=1)  # (m, k), most similar first
        # Less the row's top similarity: one factor on all of a row's votes, and no overflow at small temperatures.
        weights = ((nearest - nearest[:, :1]) / temperature).exp()
        votes = torch.zeros(len(chunk), num_classes, dtype=weights.dtype, device=weights.device)
        predictions.append(votes.scatter_add_(1, labels[index], weights).argmax(dim=1))  # (m,)
    return torch.cat(predictions)


def knn_accuracy(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    num_classes: int,
    k: int = DEFAULTS.knn_k,
    temperature: float = DEFAULTS.knn_temperature,
    chunk_size: int = 1024,
) -> float:
    """(N, D), (N,), (M, D), (M,) -> the top-1 accuracy of knn_predictions on the test features."""
    predictions = knn_predictions(
        train_features,
        train_labels,
        test_features,
        num_classes=num_classes,
        k=k,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return (predictions == test_labels.to(predictions.device)).double().mean().item()
