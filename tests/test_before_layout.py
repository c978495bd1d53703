"""What users made before the package was split into subpackages still works.

`tests/fixtures/before-layout/` holds two checkpoints written by `mpp fit` before the move (the
demo configs with a 16-wide, 1-block encoder, 2 steps each; the commands are in its README):
the pretraining one still fine-tunes, the fine-tuning one still resumes. The class paths that
the configs of that time named still load, as the same classes the new paths name.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
from workspace import ROOT, console_script, make_workspace, run

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


def load(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", OLD_CLASS_PATHS)
def test_a_class_path_of_before_the_move_still_loads(path: str) -> None:
    cls = load(path)
    assert isinstance(cls, type) and cls.__name__ == path.rpartition(".")[2]
    assert cls.__module__.startswith("mpp.")
    assert load(f"{cls.__module__}.{cls.__name__}") is cls  # the same class as at its new home


def test_an_old_module_name_warns_with_its_new_one() -> None:
    sys.modules.pop("mpp.callbacks", None)  # as in a fresh process: the warning comes on first import
    with pytest.warns(FutureWarning, match=r"mpp\.callbacks is now mpp\.train\.callbacks"):
        module = importlib.import_module("mpp.callbacks")
    assert module is importlib.import_module("mpp.train.callbacks")


def test_a_saved_config_naming_the_old_class_paths_still_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    from mpp.cli import main

    old = (ROOT / "configs" / "pretrain" / "demo.yaml").read_text()
    for new, was in [("mpp.train.callbacks.", "mpp.callbacks."), ("mpp.eval.fewshot.", "mpp.fewshot.")]:
        old = old.replace(new, was)
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "demo.yaml").write_text(old)
    shutil.copytree(ROOT / "configs" / "model", tmp_path / "model")  # what its __base__ names
    monkeypatch.chdir(ROOT)
    for name in ("mpp.callbacks", "mpp.fewshot"):  # as in a fresh process: the warning comes on first import
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.warns(FutureWarning, match="is now mpp"), pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(tmp_path / "pretrain" / "demo.yaml"), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: mpp.callbacks.PredictionPictures" in printed
    assert "class_path: mpp.fewshot.FewShotEvaluation" in printed


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
    result, _ = run([console_script("mpp"), "fit", "--config", "configs/trainer/cpu.yaml", "--config",
                     "configs/finetune/demo.yaml", *ENCODER, *SMALL, "--trainer.max_steps", "3",
                     "--ckpt_path", "last"], user)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states" in result.stdout + result.stderr
    after = torch.load(user / "runs" / "demo" / "finetune" / "checkpoints" / "last.ckpt", weights_only=True)
    assert after["global_step"] == 3
    assert after["hyper_parameters"]["_class_path"] == before["hyper_parameters"]["_class_path"]
