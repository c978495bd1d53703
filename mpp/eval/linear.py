"""Few-shot linear evaluation (section 4.1): regularised least squares, solved in closed form, from
frozen image representations to {-1, 1}^K targets. The paper chose between masked patch
prediction variants by this number. Its defaults, one set for every caller, are here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

BIAS_FEATURE = 100.0


@dataclass(frozen=True)
class FewShotSettings:
    """The defaults of few-shot evaluation, for the callback, evaluate_checkpoint and tools/fewshot.py alike
    (what each means: FewShotEvaluation's Args). One worker count for all: DataLoader workers split the
    shards between them, which changes which samples come first, and so the accuracy."""

    shots: tuple[int, ...] = (1, 5, 10, 25)
    seeds: int = 3
    every_n_steps: int = 1000
    max_train: int = 10000
    max_test: int = 10000
    l2: float = 1024.0
    batch_size: int = 256
    num_workers: int = 0
    eval_crop_fraction: float = 1.0


DEFAULTS = FewShotSettings()


def fewshot_accuracy(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    num_classes: int,
    l2: float = DEFAULTS.l2,
) -> float:
    """(N, D), (N,), (M, D), (M,) -> top-1 accuracy on the test features of the ridge regression
    fitted to the train features: features standardised with the train statistics plus a bias
    column make X, targets in {-1, 1}^K make Y, and W solves (XᵀX + l2·I) W = XᵀY in float64."""
    x, x_test = train_features.double(), test_features.double()
    mean, std = x.mean(dim=0), x.std(dim=0, unbiased=False) + 1e-5
    x, x_test = (x - mean) / std, (x_test - mean) / std
    # A bias column of a large constant: its weight is barely regularised, as a bias should be.
    x = torch.cat([x, torch.full_like(x[:, :1], BIAS_FEATURE)], dim=1)
    x_test = torch.cat([x_test, torch.full_like(x_test[:, :1], BIAS_FEATURE)], dim=1)
    targets = 2.0 * nn.functional.one_hot(train_labels.long(), num_classes).double() - 1.0  # (N, K)
    gram = x.T @ x + l2 * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    weights = torch.linalg.solve(gram, x.T @ targets)  # (D + 1, K)
    predictions = (x_test @ weights).argmax(dim=1)
    return (predictions == test_labels.to(predictions.device)).double().mean().item()


def pick_shots(labels: Tensor, *, shots: int, num_classes: int, seed: int) -> Tensor:
    """(N,) labels -> (shots · K,) indices: `shots` examples of every class, drawn with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for label in range(num_classes):
        (members,) = torch.nonzero(labels.cpu() == label, as_tuple=True)
        if len(members) < shots:
            raise ValueError(
                f"class {label} has {len(members)} few-shot training examples, fewer than {shots} shots: "
                "give more training samples (max_train), shards that mix the classes, or fewer shots"
            )
        chosen.append(members[torch.randperm(len(members), generator=generator)[:shots]])
    return torch.cat(chosen)


def fewshot_evaluation(
    features: Tensor,
    labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    shots: Sequence[int] = DEFAULTS.shots,
    seeds: int = DEFAULTS.seeds,
    num_classes: int,
    l2: float = DEFAULTS.l2,
) -> dict[int, float]:
    """(N, D), (N,), (M, D), (M,) -> {n: accuracy on all test features, averaged over `seeds`
    draws of n training examples per class}."""
    results = {}
    for n in shots:
        accuracies = []
        for seed in range(seeds):
            chosen = pick_shots(labels, shots=n, num_classes=num_classes, seed=seed)
            accuracies.append(
                fewshot_accuracy(
                    features[chosen], labels[chosen], test_features, test_labels, num_classes=num_classes, l2=l2
                )
            )
        results[n] = sum(accuracies) / len(accuracies)
    return results
