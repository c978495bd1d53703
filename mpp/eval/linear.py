"""Linear evaluation of frozen image representations by regularised least squares, solved in closed
form, to {-1, 1}^K targets: few-shot (section 4.1; the paper chose between masked patch prediction
variants by this number), and a linear probe on all training labels whose l2 is chosen on held-out
training features. The defaults of every frozen-encoder evaluation, one set for every caller, are here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

BIAS_FEATURE = 100.0


@dataclass(frozen=True)
class FewShotSettings:
    """The defaults of frozen-encoder evaluation, for the callback, evaluate_checkpoint and mpp evaluate alike
    (what each means: mpp.eval.fewshot.FewShotConfig's Args). One worker count for all: DataLoader workers split the
    shards between them, which changes which samples come first, and so the accuracy.

    k-NN takes DINO's k = 20 and temperature 0.07. The probe's l2 grid is the powers of 4 from 4^-2 to
    4^7: with standardised features XᵀX grows with the sample count, so thousands of training labels
    want an l2 from well below to well above the few-shot 1024 (4^5); a step of 4 keeps it to ten fits.
    """

    shots: tuple[int, ...] = (1, 5, 10, 25)
    seeds: int = 3
    every_n_steps: int = 1000
    max_train: int = 10000
    max_test: int = 10000
    l2: float = 1024.0
    knn_k: int = 20
    knn_temperature: float = 0.07
    probe_l2s: tuple[float, ...] = tuple(4.0**power for power in range(-2, 8))
    probe_held_out: float = 0.2
    batch_size: int = 256
    num_workers: int = 0
    eval_crop_fraction: float = 1.0


DEFAULTS = FewShotSettings()


def design_matrices(train_features: Tensor, *others: Tensor) -> list[Tensor]:
    """(N, D), then any (M, D) -> float64 (N, D + 1), (M, D + 1), ...: every set standardised with the
    statistics of the first, and a bias column appended."""
    x = train_features.double()
    mean, std = x.mean(dim=0), x.std(dim=0, unbiased=False) + 1e-5
    matrices = []
    for features in (x, *others):
        standardised = (features.double() - mean) / std
        # A bias column of a large constant: its weight is barely regularised, as a bias should be.
        matrices.append(torch.cat([standardised, torch.full_like(standardised[:, :1], BIAS_FEATURE)], dim=1))
    return matrices


def ridge_weights(x: Tensor, labels: Tensor, *, num_classes: int, l2s: Sequence[float]) -> list[Tensor]:
    """(N, D + 1) design matrix X, (N,) labels -> one (D + 1, K) W per l2, solving (XᵀX + l2·I) W = XᵀY
    for targets Y in {-1, 1}^K; XᵀX and XᵀY, the costly part, are computed once for all of them."""
    targets = 2.0 * nn.functional.one_hot(labels.long(), num_classes).double() - 1.0  # (N, K)
    gram, moments = x.T @ x, x.T @ targets
    identity = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    return [torch.linalg.solve(gram + l2 * identity, moments) for l2 in l2s]


def top1(x: Tensor, weights: Tensor, labels: Tensor) -> float:
    """(M, D + 1) design matrix, (D + 1, K) weights, (M,) labels -> the fraction whose largest score is the label."""
    predictions = (x @ weights).argmax(dim=1)
    return (predictions == labels.to(predictions.device)).double().mean().item()


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
    x, x_test = design_matrices(train_features, test_features)
    (weights,) = ridge_weights(x, train_labels, num_classes=num_classes, l2s=[l2])
    return top1(x_test, weights, test_labels)


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


def held_out_split(count: int, *, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """count -> (fit indices, held-out indices): a random `fraction` of range(count), drawn with `seed`,
    is held out."""
    held = round(fraction * count)
    if not 0 < held < count:
        raise ValueError(
            f"a held-out fraction of {fraction} of {count} training features holds out {held}: the linear "
            "probe needs some to fit and some to choose its l2 on; give more training samples (max_train) "
            "or a probe_held_out between 0 and 1"
        )
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[held:], order[:held]


def choose_l2(
    features: Tensor,
    labels: Tensor,
    *,
    num_classes: int,
    l2s: Sequence[float] = DEFAULTS.probe_l2s,
    held_out: float = DEFAULTS.probe_held_out,
    seed: int = 0,
) -> float:
    """(N, D), (N,) training features and labels -> the l2 of `l2s` whose ridge regression, fitted to the
    rest, is most accurate on the held-out `held_out` of them. Ties go to the largest l2: of equally
    accurate fits, the most regularised."""
    if not l2s or min(l2s) <= 0:
        raise ValueError(f"the linear probe's l2s must be positive values to choose from, got {list(l2s)}")
    fit, held = held_out_split(len(labels), fraction=held_out, seed=seed)
    x_fit, x_held = design_matrices(features[fit], features[held])
    weights = ridge_weights(x_fit, labels[fit], num_classes=num_classes, l2s=l2s)
    accuracies = [top1(x_held, w, labels[held]) for w in weights]
    best = max(accuracies)
    return max(l2 for l2, accuracy in zip(l2s, accuracies) if accuracy == best)


class Probe(NamedTuple):
    """A linear probe's test accuracy and the l2 it chose."""

    accuracy: float
    l2: float


def linear_probe(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    num_classes: int,
    l2s: Sequence[float] = DEFAULTS.probe_l2s,
    held_out: float = DEFAULTS.probe_held_out,
    seed: int = 0,
) -> Probe:
    """(N, D), (N,), (M, D), (M,) -> the top-1 test accuracy of fewshot_accuracy's ridge regression fitted
    to all N training labels, and its l2. The l2 is chosen from `l2s` on the training features alone
    (choose_l2), then the regression is refitted on all of them; the test set is only scored."""
    l2 = choose_l2(train_features, train_labels, num_classes=num_classes, l2s=l2s, held_out=held_out, seed=seed)
    accuracy = fewshot_accuracy(
        train_features, train_labels, test_features, test_labels, num_classes=num_classes, l2=l2
    )
    return Probe(accuracy, l2)
