"""k-NN and linear-probe evaluation of frozen features, on cases whose answers can be worked out by
hand: what the nearest neighbours vote and with what weight, and which l2 the probe must choose."""

from __future__ import annotations

import math

import pytest
import torch

from mpp.eval.knn import knn_accuracy, knn_predictions
from mpp.eval.linear import DEFAULTS, choose_l2, fewshot_accuracy, held_out_split, linear_probe


def at_similarity(*similarities: float) -> torch.Tensor:
    """(len, 2) unit vectors whose cosine similarities to (1, 0) are the given ones."""
    return torch.tensor([[s, math.sqrt(1 - s * s)] for s in similarities])


QUERY = torch.tensor([[1.0, 0.0]])


def clusters(per_class: int, *, classes: int = 10, dim: int = 32, noise: float = 0.1, seed: int = 0):
    """(N, dim) features around class means far apart, (N,) labels."""
    generator = torch.Generator().manual_seed(seed)
    means = 10 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(123))
    labels = torch.arange(classes).repeat_interleave(per_class)
    return means[labels] + noise * torch.randn(len(labels), dim, generator=generator), labels


def noisy(seed: int, *, count: int = 150, dim: int = 60, classes: int = 3):
    """(count, dim) features of which three carry the class a little above the noise, (count,) labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (count,), generator=generator)
    features = torch.randn(count, dim, generator=generator)
    features[:, :classes] += torch.nn.functional.one_hot(labels, classes)
    return features, labels


def test_every_test_point_that_is_a_training_point_finds_its_own_label():
    # Random directions and random labels: no class structure, so only finding itself gets it right.
    generator = torch.Generator().manual_seed(0)
    features, labels = torch.randn(300, 16, generator=generator), torch.randint(0, 10, (300,), generator=generator)
    scaled = 7.5 * features  # the same directions: L2 normalisation makes lengths irrelevant
    assert knn_accuracy(features, labels, scaled, labels, num_classes=10, k=1) == 1.0
    # With DINO's k and temperature, on classes that cluster, every one of k = 20 voters is weighed in.
    features, labels = clusters(30)
    assert knn_accuracy(features, labels, 0.5 * features, labels, num_classes=10) == 1.0


def test_one_neighbour_and_three_weighted_neighbours_disagree_as_computed_by_hand():
    # The nearest is class 0 (similarity 0.95); the next two are class 1 (0.93, 0.92); class 2 is far.
    train = at_similarity(0.95, 0.93, 0.92, -0.5)
    labels = torch.tensor([0, 1, 1, 2])
    # By hand, at T = 0.07: class 1 gets e^(0.93/T) + e^(0.92/T) = 1.40 e^(0.95/T), more than class 0's e^(0.95/T).
    assert math.exp(0.93 / 0.07) + math.exp(0.92 / 0.07) > 1.4 * math.exp(0.95 / 0.07)
    one = knn_predictions(train, labels, QUERY, num_classes=3, k=1)
    three = knn_predictions(train, labels, QUERY, num_classes=3, k=3, temperature=0.07)
    assert one.tolist() == [0] and three.tolist() == [1]
    # At T = 0.01 the nearest dominates again: e^-2 + e^-3 = 0.19 of its weight.
    assert knn_predictions(train, labels, QUERY, num_classes=3, k=3, temperature=0.01).tolist() == [0]
    assert knn_accuracy(train, labels, QUERY, torch.tensor([1]), num_classes=3, k=3, temperature=0.07) == 1.0


def test_the_temperature_decides_a_tie_of_two_votes_against_two():
    # k = 4: two neighbours of each class. Class 0 has the nearest (0.9) and a far one (0.0); class 1 has
    # two in between (0.6, 0.5). Class 2 at -0.9 is fifth and never votes.
    train = at_similarity(0.9, 0.0, 0.6, 0.5, -0.9)
    labels = torch.tensor([0, 0, 1, 1, 2])
    # By hand: at T = 0.07, e^(0.9/T) + 1 ≈ 383,000 against e^(0.6/T) + e^(0.5/T) ≈ 6,550 -> class 0;
    # at T = 10 the weights are nearly linear in s, and class 1's sum of 1.1 beats class 0's 0.9:
    # e^0.09 + e^0 = 2.094 against e^0.06 + e^0.05 = 2.113 -> class 1.
    assert math.exp(0.09) + 1 < math.exp(0.06) + math.exp(0.05)
    sharp = knn_predictions(train, labels, QUERY, num_classes=3, k=4, temperature=0.07)
    flat = knn_predictions(train, labels, QUERY, num_classes=3, k=4, temperature=10.0)
    assert sharp.tolist() == [0] and flat.tolist() == [1]


def test_chunks_of_test_features_give_the_predictions_of_one_pass():
    features, labels = clusters(50, classes=5, dim=16, noise=12.0)  # overlapping: the votes are close
    test_features, _ = clusters(60, classes=5, dim=16, noise=12.0, seed=1)
    whole = knn_predictions(features, labels, test_features, num_classes=5, chunk_size=len(test_features))
    assert len(whole) == 300 and len(set(whole.tolist())) == 5
    for chunk_size in (1, 7, 128, 10_000):
        assert torch.equal(knn_predictions(features, labels, test_features, num_classes=5, chunk_size=chunk_size), whole)


def test_k_beyond_the_training_set_lets_all_vote_and_nonsense_is_refused():
    train, labels = at_similarity(0.9, 0.8, 0.7), torch.tensor([0, 1, 1])
    # k = 50 of 3: all three vote; at T = 1, class 1's e^0.8 + e^0.7 = 4.24 beats class 0's e^0.9 = 2.46.
    assert math.exp(0.8) + math.exp(0.7) > math.exp(0.9)
    assert knn_predictions(train, labels, QUERY, num_classes=2, k=50, temperature=1.0).tolist() == [1]
    assert knn_predictions(train, labels, QUERY, num_classes=2, k=1, temperature=1.0).tolist() == [0]
    with pytest.raises(ValueError, match="k=0"):
        knn_accuracy(train, labels, QUERY, torch.tensor([0]), num_classes=2, k=0)
    with pytest.raises(ValueError, match="temperature=0"):
        knn_accuracy(train, labels, QUERY, torch.tensor([0]), num_classes=2, temperature=0)


def test_the_probe_separates_separable_clusters_completely():
    features, labels = clusters(50)
    test_features, test_labels = clusters(20, seed=1)
    probe = linear_probe(features, labels, test_features, test_labels, num_classes=10)
    assert probe.accuracy == 1.0 and probe.l2 in DEFAULTS.probe_l2s


def test_the_probe_finds_a_direction_that_nearest_neighbours_do_not():
    # The class is the sign of feature 0; 31 larger noise features swamp it for cosine similarity.
    def signs(seed: int):
        generator = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, 2, (400,), generator=generator)
        features = 10 * torch.randn(400, 32, generator=generator)
        features[:, 0] = (2 * labels - 1) * (1 + torch.rand(400, generator=generator))
        return features, labels

    (features, labels), (test_features, test_labels) = signs(0), signs(1)
    assert linear_probe(features, labels, test_features, test_labels, num_classes=2).accuracy == 1.0
    assert knn_accuracy(features, labels, test_features, test_labels, num_classes=2) < 0.65


def test_a_huge_l2_loses_to_a_small_one_where_the_classes_are_unbalanced():
    # Three times as many of class 0. At l2 = 1e12 the weights are XᵀY / l2 to first order, so a class's
    # score is dominated by the bias column's 100² · (its count - the other's): every held-out point goes
    # to class 0, and the held-out accuracy is class 0's share, below the small l2's 100%.
    generator = torch.Generator().manual_seed(0)
    labels = torch.tensor([0] * 150 + [1] * 50)
    features = torch.tensor([[5.0] * 8, [-5.0] * 8])[labels] + torch.randn(200, 8, generator=generator)
    fit, held = held_out_split(200, fraction=0.2, seed=0)
    share = (labels[held] == 0).double().mean().item()
    assert share < 1.0
    assert fewshot_accuracy(features[fit], labels[fit], features[held], labels[held], num_classes=2, l2=1e12) == share
    for grid in ((1e-2, 1e12), (1e12, 1e-2)):  # by accuracy, not by place in the grid
        assert choose_l2(features, labels, num_classes=2, l2s=grid) == 1e-2
    # Both small ones reach 100%: the tie goes to the larger, the more regularised.
    assert choose_l2(features, labels, num_classes=2, l2s=(1e-2, 1e-1)) == 1e-1


@pytest.mark.parametrize("seed", [16, 15])
def test_the_chosen_l2_is_the_one_most_accurate_on_the_held_out_training_features(seed):
    """Recomputed here one l2 at a time with fewshot_accuracy; seed 16 has one best l2 inside the grid,
    seed 15 two tied ones (the larger wins)."""
    features, labels = noisy(seed)
    fit, held = held_out_split(len(labels), fraction=DEFAULTS.probe_held_out, seed=0)
    accuracies = {
        l2: fewshot_accuracy(features[fit], labels[fit], features[held], labels[held], num_classes=3, l2=l2)
        for l2 in DEFAULTS.probe_l2s
    }
    best = [l2 for l2, accuracy in accuracies.items() if accuracy == max(accuracies.values())]
    # The case tells the rule apart from "always the smallest" or "always the largest".
    assert min(DEFAULTS.probe_l2s) < best[0] and best[-1] < max(DEFAULTS.probe_l2s)
    assert len(best) == (1 if seed == 16 else 2)
    assert choose_l2(features, labels, num_classes=3) == best[-1]
    test_features, test_labels = noisy(100 + seed)
    probe = linear_probe(features, labels, test_features, test_labels, num_classes=3)
    assert probe.l2 == best[-1]
    # Then refitted on all the training features, not the 80% it was chosen on.
    assert probe.accuracy == fewshot_accuracy(features, labels, test_features, test_labels, num_classes=3, l2=best[-1])


def test_the_probe_chooses_its_l2_without_the_test_set():
    features, labels = noisy(16)
    test_features, test_labels = noisy(116)
    probe = linear_probe(features, labels, test_features, test_labels, num_classes=3)
    shuffled = test_labels[torch.randperm(len(test_labels), generator=torch.Generator().manual_seed(0))]
    permuted = linear_probe(features, labels, test_features, shuffled, num_classes=3)
    other = linear_probe(features, labels, 5 * torch.randn_like(test_features), test_labels, num_classes=3)
    assert permuted.l2 == other.l2 == probe.l2
    assert permuted.accuracy != probe.accuracy  # the test labels are read, for the score alone


def test_the_held_out_split_is_a_seeded_random_fifth_of_the_training_features():
    fit, held = held_out_split(100, fraction=0.2, seed=0)
    assert len(held) == 20 and sorted([*fit.tolist(), *held.tolist()]) == list(range(100))
    assert held.tolist() not in (list(range(20)), list(range(80, 100)))  # drawn, not the first or last fifth
    assert torch.equal(held_out_split(100, fraction=0.2, seed=0)[1], held)
    assert not torch.equal(held_out_split(100, fraction=0.2, seed=1)[1], held)
    with pytest.raises(ValueError, match="a held-out fraction of 0.1 of 4 training features holds out 0"):
        held_out_split(4, fraction=0.1, seed=0)
    with pytest.raises(ValueError, match="l2s must be positive"):
        choose_l2(*noisy(0), num_classes=3, l2s=())
