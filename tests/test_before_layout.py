"""What users made before the package was split into subpackages, and before its files were named by
their subject (mpp.moved), still runs: old class paths in configs and checkpoints are read as today's.

`tests/fixtures/before-layout/` holds two checkpoints written by `mpp fit` before the move (the
demo configs with a 16-wide, 1-block encoder, 2 steps each; the commands are in its README):
the pretraining one still fine-tunes, the fine-tuning one, its class path an old one, still resumes.
The old module names no longer import: nothing hooks Python's imports.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
from workspace import ROOT, console_script, make_workspace, run

from mpp.model.checkpoint import read_checkpoint
from mpp.moved import MOVED_MODULES, current_class_path

FIXTURES = ROOT / "tests" / "fixtures" / "before-layout"
ENCODER = ["--model.init_args.encoder.dim", "16", "--model.init_args.encoder.depth", "1",
           "--model.init_args.encoder.heads", "2", "--model.init_args.encoder.mlp_dim", "32"]
SMALL = ["--data.batch_size", "4", "--data.num_workers", "0", "--data.samples_per_epoch", "16",
         "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]
# Every class path the shipped configs named before the move, and the other public classes.
OLD_CLASS_PATHS = [
    "mpp.MaskedPatchPretraining", "mpp.ImageClassifier", "mpp.ShardDataModule", "mpp.ViT", "mpp.ViTConfig",
    "mpp.callbacks.ThroughputMonitor", "mpp.callbacks.ProgressBar", "mpp.callbacks.PredictionPictures",
    "mpp.callbacks.RankFailure", "mpp.fewshot.FewShotEvaluation", "mpp.strategies.BlockFSDPStrategy",
    "mpp.pretrain.MaskedPatchPretraining", "mpp.classify.ImageClassifier", "mpp.data.ShardDataModule",
    "mpp.checkpointing.AtomicCheckpointIO", "mpp.guards.LossGuardCheck", "mpp.wandb_run.WandbRunCheckpoint",
]


# Renamed since, and the classes that left a module they shared.
RENAMED = ["mpp.train.guards.LossGuardCheck", "mpp.train.draws.StepDraws", "mpp.train.callbacks.PredictionPictures",
           "mpp.eval.analyses.EncoderAnalysis", "mpp.callbacks.PredictionPictures",
           "mpp.train.callbacks.ThroughputMonitor", "mpp.train.prediction_pictures.PredictionPictures",
           "mpp.train.checkpoint_io.AtomicCheckpointIO", "mpp.train.wandb_run.WandbRunCheckpoint",
           "mpp.train.predictions.PredictionWriter"]
# Classes with a new name: Lightning has a ThroughputMonitor of its own.
NEW_NAMES = {"ThroughputMonitor": "ImageThroughput"}


def load(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", OLD_CLASS_PATHS + RENAMED)
def test_an_old_class_path_reads_as_the_class_at_its_home_today(path: str) -> None:
    cls = load(current_class_path(path))
    name = path.rpartition(".")[2]
    assert isinstance(cls, type) and cls.__name__ == NEW_NAMES.get(name, name)
    assert load(f"{cls.__module__}.{cls.__name__}") is cls  # the same class as at its home


@pytest.mark.parametrize("module", sorted(MOVED_MODULES))
def test_an_old_module_name_no_longer_imports(module: str) -> None:
    assert not any(type(finder).__module__.startswith("mpp") for finder in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


def old_demo_config(folder: Path) -> Path:
    """configs/pretrain/demo.yaml as a run of before would have saved it, naming the old class paths."""
    old = (ROOT / "configs" / "pretrain" / "demo.yaml").read_text()
    for new, was in [("mpp.outputs.prediction_pictures.PredictionPictures", "mpp.callbacks.PredictionPictures"),
                     ("mpp.train.callbacks.ImageThroughput", "mpp.callbacks.ThroughputMonitor"),
                     ("mpp.train.callbacks.", "mpp.callbacks."), ("mpp.eval.fewshot.", "mpp.fewshot."),
                     ("mpp.eval.analysis_callback.", "mpp.eval.analyses."), ("mpp.MaskedPatchPretraining",
                                                                              "mpp.pretrain.MaskedPatchPretraining")]:
        assert new in old
        old = old.replace(new, was)
    (folder / "pretrain").mkdir()
    (folder / "pretrain" / "demo.yaml").write_text(old)
    shutil.copytree(ROOT / "configs" / "model", folder / "model")  # what its __base__ names
    return folder / "pretrain" / "demo.yaml"


def test_a_saved_config_naming_the_old_class_paths_runs_as_todays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from mpp.cli import main

    config = old_demo_config(tmp_path)
    monkeypatch.chdir(ROOT)
    with pytest.warns(FutureWarning) as said, pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_.value.code in (0, None)
    assert "the config names mpp.callbacks.ProgressBar, which is mpp.train.callbacks.ProgressBar now: name that " \
           "instead" in {str(warning.message) for warning in said}
    printed = capsys.readouterr().out
    for path in ("mpp.outputs.prediction_pictures.PredictionPictures", "mpp.train.callbacks.ProgressBar",
                 "mpp.train.callbacks.ImageThroughput",
                 "mpp.eval.fewshot.FewShotEvaluation", "mpp.eval.analysis_callback.EncoderAnalysis",
                 "mpp.train.pretrain.MaskedPatchPretraining"):
        assert f"class_path: {path}\n" in printed
    assert "mpp.callbacks." not in printed and "mpp.eval.analyses." not in printed


def test_a_checkpoint_naming_an_old_class_path_is_read_as_naming_todays(tmp_path: Path) -> None:
    checkpoint = torch.load(FIXTURES / "finetune.ckpt", weights_only=True)  # plain data and tensors only
    checkpoint["hyper_parameters"]["_class_path"] = "mpp.classify.ImageClassifier"
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.warns(FutureWarning, match=r"old\.ckpt names mpp\.classify\.ImageClassifier, which is "
                                           r"mpp\.train\.classify\.ImageClassifier now"):
        read = read_checkpoint(str(tmp_path / "old.ckpt"))
    assert read["hyper_parameters"]["_class_path"] == "mpp.train.classify.ImageClassifier"


@pytest.mark.parametrize("path", ["mpp.shards.write_shards", "mpp.shards.WriteOptions", "mpp.data.ShardSpec",
                                  "mpp.data.EmptyEpochError", "mpp.data.WorkerDiedError"])
def test_the_packages_that_kept_an_old_module_name_hand_on_its_names(path: str) -> None:
    assert load(path) is not None


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_workspace(tmp_path_factory.mktemp("user"))
    for stage in ("pretrain", "finetune"):
        (folder / "runs" / "demo" / stage / "checkpoints").mkdir(parents=True)
        shutil.copy(FIXTURES / f"{stage}.ckpt", folder / "runs" / "demo" / stage / "checkpoints" / "last.ckpt")
    return folder


def test_a_pretraining_checkpoint_of_before_the_move_still_fine_tunes(user: Path) -> None:
    result, _ = run([console_script("mpp"), "fit", "--config", "configs/trainer/cpu.yaml", "--config",
                     "configs/finetune/demo.yaml", *ENCODER, *SMALL, "--trainer.max_steps", "1",
                     "--trainer.default_root_dir", "runs/fresh-finetune"], user)
    assert result.returncode == 0, result.stderr[-3000:]
    pretrained = torch.load(FIXTURES / "pretrain.ckpt", weights_only=True)["state_dict"]
    tuned = torch.load(user / "runs" / "fresh-finetune" / "checkpoints" / "last.ckpt", weights_only=True)
    assert tuned["global_step"] == 1
    # The encoder came from the old checkpoint: one SGD step moves the weights only a little.
    old = pretrained["encoder.patch_embed.weight"]
    new = tuned["state_dict"]["encoder.patch_embed.weight"]
    assert (new - old).abs().max() < 0.05 * old.abs().max()


def test_a_fine_tuning_checkpoint_of_before_the_move_still_resumes(user: Path) -> None:
    before = torch.load(FIXTURES / "finetune.ckpt", weights_only=True)
    assert before["global_step"] == 2
    before["hyper_parameters"]["_class_path"] = "mpp.classify.ImageClassifier"  # as an old config could name it
    torch.save(before, user / "runs" / "demo" / "finetune" / "checkpoints" / "last.ckpt")
    result, _ = run([console_script("mpp"), "fit", "--config", "configs/trainer/cpu.yaml", "--config",
                     "configs/finetune/demo.yaml", *ENCODER, *SMALL, "--trainer.max_steps", "3",
                     "--ckpt_path", "runs/demo/finetune/checkpoints/last.ckpt"], user)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states" in result.stdout + result.stderr
    after = torch.load(user / "runs" / "demo" / "finetune" / "checkpoints" / "last.ckpt", weights_only=True)
    assert after["global_step"] == 3
    assert "mpp.classify.ImageClassifier, which is mpp.train.classify.ImageClassifier now" in result.stderr
    assert after["hyper_parameters"]["_class_path"] == "mpp.train.classify.ImageClassifier"  # where it lives today
