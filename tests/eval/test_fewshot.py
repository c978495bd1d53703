"""Few-shot linear evaluation: the closed-form regression separates what is separable and no more,
averages over seeds, and runs — with k-NN and the linear probe, on features extracted once — as a
callback in a real pretraining fit and as a tool."""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from shardkit import encode, sample, write_shard
from workspace import mpp_command

import mpp.commands.evaluate as evaluate_command
import mpp.eval.fewshot
from mpp import MaskedPatchPretraining, OptimizerConfig, ShardDataModule, ViT, ViTConfig
from mpp.eval.fewshot import FewShotEvaluation, extract_features
from mpp.eval.frozen import evaluate_checkpoint, score_features
from mpp.eval.knn import knn_accuracy, knn_predictions
from mpp.eval.linear import DEFAULTS, choose_l2, fewshot_accuracy, fewshot_evaluation, linear_probe, pick_shots


def clusters(per_class: int, *, classes: int = 10, dim: int = 32, noise: float = 0.1, seed: int = 0):
    """(N, dim) features around class means far apart, (N,) labels."""
    generator = torch.Generator().manual_seed(seed)
    means = 10 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(123))
    labels = torch.arange(classes).repeat_interleave(per_class)
    return means[labels] + noise * torch.randn(len(labels), dim, generator=generator), labels


def test_separable_classes_are_all_recognised_from_five_shots():
    features, labels = clusters(5)
    test_features, test_labels = clusters(20, seed=1)
    assert fewshot_accuracy(features, labels, test_features, test_labels, num_classes=10) == 1.0


def test_random_labels_stay_at_chance():
    generator = torch.Generator().manual_seed(0)
    features, test_features = torch.randn(250, 32, generator=generator), torch.randn(2000, 32, generator=generator)
    labels = torch.randint(0, 10, (250,), generator=generator)
    test_labels = torch.randint(0, 10, (2000,), generator=generator)
    assert fewshot_accuracy(features, labels, test_features, test_labels, num_classes=10) < 0.15


def test_shots_are_drawn_per_class_and_differ_by_seed():
    labels = torch.arange(5).repeat(20)  # 20 examples of each of 5 classes, interleaved
    first, second = (pick_shots(labels, shots=3, num_classes=5, seed=s) for s in (0, 1))
    assert torch.bincount(labels[first], minlength=5).tolist() == [3] * 5 and len(set(first.tolist())) == 15
    assert set(first.tolist()) != set(second.tolist())
    assert torch.equal(first, pick_shots(labels, shots=3, num_classes=5, seed=0))
    with pytest.raises(ValueError, match="class 2 has 1 few-shot training examples, fewer than 2 shots"):
        pick_shots(torch.tensor([0, 0, 1, 1, 2]), shots=2, num_classes=3, seed=0)


def test_evaluation_averages_over_seeds_for_every_shot_count():
    # Overlapping clusters, so accuracies vary from draw to draw.
    features, labels = clusters(30, classes=4, dim=8, noise=12.0)
    test_features, test_labels = clusters(30, classes=4, dim=8, noise=12.0, seed=1)
    results = fewshot_evaluation(features, labels, test_features, test_labels, shots=(1, 2, 5), seeds=3, num_classes=4)
    assert list(results) == [1, 2, 5]
    for n, accuracy in results.items():
        draws = [
            fewshot_accuracy(features[chosen], labels[chosen], test_features, test_labels, num_classes=4)
            for chosen in (pick_shots(labels, shots=n, num_classes=4, seed=seed) for seed in range(3))
        ]
        assert len(set(draws)) > 1 and accuracy == pytest.approx(sum(draws) / 3)


def labelled_shards(folder: Path, prefix: str, count: int) -> str:
    """One shard of `count` 16 px images in 3 classes (a colour each, varied in brightness)."""
    folder.mkdir(exist_ok=True)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200)]

    def record(index: int) -> dict:
        label, shade = index % 3, (index // 3) % 8 * 6
        image = Image.new("RGB", (16, 16), tuple(c + shade for c in colours[label]))
        return {"__key__": f"{prefix}{index:06d}", "png": encode(image), "cls": str(label).encode()}

    return write_shard(folder / f"{prefix}-000000.tar", (record(i) for i in range(count)))


def test_callback_logs_fewshot_accuracy_during_pretraining_and_the_tool_reads_the_checkpoint(tmp_path, monkeypatch):
    pl.seed_everything(0)
    extractions = []  # one per feature set: k-NN and the probe take the few-shot features, not their own

    def counted(*args, **kwargs):
        extractions.append(1)
        return extract_features(*args, **kwargs)

    monkeypatch.setattr(mpp.eval.fewshot, "extract_features", counted)
    train = labelled_shards(tmp_path / "shards", "train", 48)
    test = labelled_shards(tmp_path / "shards", "test", 30)
    encoder = ViTConfig(image_size=16, patch_size=4, dim=32, depth=1, heads=2, mlp_dim=64)
    model = MaskedPatchPretraining(encoder=encoder, optimizer=OptimizerConfig(name="adamw", lr=1e-3))
    # The images of both take the encoder's size and channels.
    callback = FewShotEvaluation(train=train, test=test, num_classes=3, shots=(1, 2), seeds=2, every_n_steps=2,
                                 max_train=30, max_test=30, batch_size=16)
    data = ShardDataModule(train=train, batch_size=8, num_workers=0, shuffle_buffer=0)
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", logger=pl.loggers.CSVLogger(tmp_path), callbacks=[callback],
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, data)
    # At the start, every 2 steps and at the end (step 5).
    assert sorted(callback.history) == [0, 2, 4, 5] and len(extractions) == 2 * 4  # train and test, 4 times
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("fewshot/1shot")]
    assert [int(row["step"]) for row in rows] == [0, 2, 4, 5]
    for row in rows:
        scores = callback.history[int(row["step"])]
        assert scores.train == 30 and scores.test == 30
        # Flat colours, one per class: the frozen features separate them from one example each,
        # and so from all 30 labels, by neighbours or by the probe.
        assert float(row["fewshot/1shot"]) == pytest.approx(scores.fewshot[1])
        assert float(row["fewshot/2shot"]) == 1.0
        assert float(row["fewshot/knn"]) == scores.knn == 1.0 and float(row["fewshot/linear"]) == scores.linear == 1.0
        assert float(row["fewshot/linear_l2"]) == scores.linear_l2 and scores.linear_l2 in DEFAULTS.probe_l2s
    assert model.encoder.training  # the evaluation handed the encoder back in training mode

    trainer.save_checkpoint(tmp_path / "mpp.ckpt")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # with the callback's own default number of workers
        code = mpp_command("evaluate", str(tmp_path / "mpp.ckpt"), "--train", train, "--test", test, "--shots", "1",
                           "2", "--seeds", "2", "--max-train", "30", "--max-test", "30",
                           "--precision", "32-true")  # the callback's, under this Trainer
    assert code == 0
    table = out.getvalue()
    assert "(30 train / 30 test images, mean of 2 seeds)" in table
    assert "| shots | accuracy |" in table and "| 2 | 100.0% |" in table
    assert f"| 1 | {100 * callback.history[5].fewshot[1]:.1f}% |" in table
    assert "| all 30 training labels | accuracy |" in table and "| k-NN (k=20, temperature 0.07) | 100.0% |" in table
    assert f"| linear probe (l2 {callback.history[5].linear_l2:g}, chosen on 20% held out) | 100.0% |" in table


def test_one_set_of_features_is_scored_by_every_evaluation_as_each_alone_scores_it():
    features, labels = clusters(30, classes=4, dim=8, noise=12.0)
    test_features, test_labels = clusters(30, classes=4, dim=8, noise=12.0, seed=1)
    settings = replace(DEFAULTS, shots=(1, 5), seeds=2, knn_k=5, knn_temperature=0.5, probe_l2s=(1.0, 64.0),
                       probe_held_out=0.25)
    scores = score_features(features, labels, test_features, test_labels, num_classes=4, settings=settings)
    probe = linear_probe(features, labels, test_features, test_labels, num_classes=4, l2s=(1.0, 64.0), held_out=0.25)
    assert scores.fewshot == fewshot_evaluation(features, labels, test_features, test_labels, shots=(1, 5), seeds=2,
                                                num_classes=4)
    assert scores.knn == knn_accuracy(features, labels, test_features, test_labels, num_classes=4, k=5,
                                      temperature=0.5)
    assert (scores.linear, scores.linear_l2) == probe and (scores.train, scores.test) == (120, 120)
    assert scores.metrics() == {"fewshot/1shot": scores.fewshot[1], "fewshot/5shot": scores.fewshot[5],
                                "fewshot/knn": scores.knn, "fewshot/linear": scores.linear,
                                "fewshot/linear_l2": scores.linear_l2}


def test_features_are_extracted_without_a_graph_and_in_the_asked_precision(tmp_path):
    encoder = ViT(ViTConfig(image_size=16, patch_size=4, dim=32, depth=1, heads=2, mlp_dim=64))
    batches = [{"image": torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), "label": torch.arange(4)}]
    features, labels = extract_features(encoder, batches, normalise=torch.nn.Identity(), device="cpu")
    assert not features.requires_grad and features.dtype == torch.float32 and labels.tolist() == [0, 1, 2, 3]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = extract_features(encoder, batches, normalise=torch.nn.Identity(), device="cpu")
    assert low.dtype == torch.float32 and not torch.equal(low, features)  # computed in bf16, handed on in float32
    torch.testing.assert_close(low, features, rtol=0.05, atol=0.05)


def test_callback_refuses_a_train_set_too_small_for_its_shots_and_knn_or_probe_settings_that_cannot_work():
    with pytest.raises(ValueError, match="max_train=20"):
        FewShotEvaluation(train="a.tar", test="b.tar", num_classes=10, shots=(1, 5), max_train=20)
    with pytest.raises(ValueError, match="FewShotEvaluation.knn_k=0 is invalid; it must be at least 1"):
        FewShotEvaluation(train="a.tar", test="b.tar", num_classes=10, knn_k=0)
    with pytest.raises(ValueError, match=r"FewShotEvaluation.probe_held_out=1.0 is invalid; it must be a fraction"):
        FewShotEvaluation(train="a.tar", test="b.tar", num_classes=10, probe_l2s=[1.0], probe_held_out=1.0)


def test_the_callback_the_function_and_the_tool_share_one_set_of_defaults():
    """mpp.eval.fewshot.DEFAULTS, as the CLI reads the callback's signature and as the tool's options."""
    from jsonargparse import ArgumentParser

    wanted = asdict(DEFAULTS)
    parser = ArgumentParser()
    parser.add_class_arguments(FewShotEvaluation, "fewshot")
    parsed = parser.get_defaults().fewshot
    assert {name: parsed[name] for name in wanted} == wanted
    # The functions' own names for the settings of k-NN and the probe.
    named = {"k": "knn_k", "temperature": "knn_temperature", "l2s": "probe_l2s", "held_out": "probe_held_out"}
    assert inspect.signature(evaluate_checkpoint).parameters["settings"].default is DEFAULTS
    functions = (fewshot_evaluation, fewshot_accuracy, knn_accuracy, knn_predictions, linear_probe, choose_l2)
    for function in functions:
        parameters = {named.get(name, name): p.default for name, p in inspect.signature(function).parameters.items()}
        defaults = {name: default for name, default in parameters.items() if name in wanted}
        assert defaults == {name: wanted[name] for name in defaults}, function.__name__
    assert DEFAULTS.probe_l2s == tuple(4.0**power for power in range(-2, 8))  # as the README and docstrings say
    options = vars(evaluate_command.argument_parser().parse_args(["a.ckpt", "--train", "a.tar", "--test", "b.tar"]))
    del wanted["every_n_steps"]  # the callback's alone
    lists = {"shots": list(DEFAULTS.shots), "probe_l2s": list(DEFAULTS.probe_l2s)}
    assert {name: options[name] for name in wanted} == {**wanted, **lists}


def test_the_callback_evaluates_on_the_runs_own_shards_unless_given_others(tmp_path, caplog):
    train = labelled_shards(tmp_path / "shards", "train", 48)
    val = labelled_shards(tmp_path / "shards", "val", 30)
    encoder = ViTConfig(image_size=16, patch_size=4, dim=32, depth=1, heads=2, mlp_dim=64)
    model = MaskedPatchPretraining(encoder=encoder, optimizer=OptimizerConfig(name="adamw", lr=1e-3))
    callback = FewShotEvaluation(shots=(1, 2, 20), seeds=2, every_n_steps=5, max_train=60, max_test=30, batch_size=16)
    data = ShardDataModule(train=train, val=val, batch_size=8, num_workers=0, shuffle_buffer=0)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[callback], limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert callback.data.specs == {"train": None, "val": train, "test": val, "predict": None}  # read as its val and test splits
    assert callback.num_classes == 3 and callback.history[1].train == 48 and callback.history[1].test == 30
    # 16 of each class: the shots they serve, the others left out and said once
    assert list(callback.history[1].fewshot) == [1, 2] and list(callback.history[0].fewshot) == [1, 2]
    assert caplog.text.count("a class has 16 examples among the 48 training samples read: 20-shot left out") == 1
    # Unlabelled shards: an error where the callback was given them, the callback off where they are the run's.
    unlabelled = write_shard(tmp_path / "u-000000.tar", [sample(i, labelled=False) for i in range(16)])
    for given, run in (({"train": unlabelled, "test": val}, train), ({}, unlabelled)):
        callback = FewShotEvaluation(**given, shots=(1,), every_n_steps=1)
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[callback], limit_val_batches=0,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        data = ShardDataModule(train=run, val=val, batch_size=8, num_workers=0, shuffle_buffer=0)
        if given:
            with pytest.raises(ValueError, match=r"FewShotEvaluation: .*u-000000\.tar and .* hold unlabelled samples"):
                trainer.fit(model, data)
        else:
            trainer.fit(model, data)
            assert callback.off and callback.history == {} and trainer.global_step == 2
            assert "hold unlabelled samples (no .cls): the run goes on without few-shot evaluation" in caplog.text
