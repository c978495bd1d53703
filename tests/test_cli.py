"""The `mpp` command: configs load, bad ones fail early, and a real fit on the embedded shards
writes checkpoints, resumes, and leaves an offline W&B run holding its metrics and pictures."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from workspace import ROOT, environment, time_limit

from mpp.cli import main
from mpp.config import read_config
from mpp.outputs.wandb_records import config as wandb_config
from mpp.outputs.wandb_records import history

DEMO = ROOT / "configs" / "pretrain" / "demo.yaml"
QUICK = [
    "--data.batch_size", "16", "--data.num_workers", "0", "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "2", "--trainer.enable_progress_bar", "false",
]


def print_config(*args: str) -> str:
    """`mpp fit ... --print_config`, in this process: the resolved config as YAML."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["fit", *args, "--print_config"])
    assert exit_.value.code in (0, None)
    return out.getvalue()


def mpp(*args: str, run_dir: Path) -> subprocess.CompletedProcess:
    """The console script in a subprocess, offline, with its run under `run_dir`."""
    env = environment()
    command = [sys.executable, "-m", "mpp", *args, "--trainer.default_root_dir", str(run_dir)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=time_limit(600))


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*/*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_config_loads(config):
    if config.parent.name == "model":  # a size preset replaces the encoder's size in a run config
        resolved = yaml.safe_load(print_config("--config", str(DEMO), "--model.encoder", str(config)))
        preset = read_config(config)  # a hybrid's preset names its ViT's as __base__ and adds the stem
        encoder = resolved["model"]["init_args"]["encoder"]
        assert {key: encoder[key] for key in preset} == preset
    elif config.parent.name == "trainer":  # a hardware preset goes before a run config
        resolved = yaml.safe_load(print_config("--config", str(config), "--config", str(DEMO)))
        assert resolved["model"]["class_path"] == "mpp.MaskedPatchPretraining"
    elif config.parent.name == "data":  # an overlay of one's own shards goes after a run config
        resolved = yaml.safe_load(print_config("--config", str(DEMO), "--config", str(config)))
        own = read_config(config)
        assert {key: resolved["data"][key] for key in own["data"]} == own["data"]
        assert resolved["model"]["init_args"]["encoder"]["channels"] == own["model"]["init_args"]["encoder"]["channels"]
    else:
        resolved = yaml.safe_load(print_config("--config", str(config)))
        assert resolved["model"]["init_args"]["encoder"]["patch_size"] >= 1


def test_a_config_mapping_starts_from_its_base_files(tmp_path, capsys):
    """`__base__` (mpp.config.load_config): the files are read in order, each relative to the config that
    names it, then the mapping's own keys; a loop or a missing file stops the run, naming the files."""
    (tmp_path / "sizes").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "sizes" / "deep.yaml").write_text("depth: 6\ndim: 64\n")
    (tmp_path / "sizes" / "wide.yaml").write_text("__base__: deep.yaml\ndim: 256\nheads: 8\n")
    run = tmp_path / "runs" / "run.yaml"
    run.write_text("model:\n  init_args:\n    encoder:\n      __base__: [../sizes/deep.yaml, ../sizes/wide.yaml]\n"
                   "      heads: 4\n")
    resolved = yaml.safe_load(print_config("--config", str(DEMO), "--config", str(run)))
    encoder = resolved["model"]["init_args"]["encoder"]
    assert (encoder["dim"], encoder["depth"], encoder["heads"], encoder["mlp_dim"], encoder["image_size"]) == (
        256, 6, 4, 512, 28)
    (tmp_path / "sizes" / "deep.yaml").write_text("__base__: wide.yaml\n")
    for base, words in [("../sizes/wide.yaml", "in a loop"), ("../sizes/none.yaml", "cannot read ../sizes/none.yaml")]:
        run.write_text(f"model:\n  init_args:\n    encoder:\n      __base__: {base}\n")
        with pytest.raises(SystemExit) as exit_:
            main(["fit", "--config", str(DEMO), "--config", str(run), "--print_config"])
        assert exit_.value.code == 2
        assert words in capsys.readouterr().err


def test_the_fsdp_preset_shards_each_vit_block():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mpp.model.vit import Block
    from mpp.train.strategies import BlockFSDPStrategy

    resolved = yaml.safe_load(print_config("--config", str(ROOT / "configs/trainer/fsdp.yaml"), "--config", str(DEMO)))
    strategy = resolved["trainer"]["strategy"]
    assert strategy["class_path"] == "mpp.train.strategies.BlockFSDPStrategy"
    built = BlockFSDPStrategy(**{**strategy["init_args"], "activation_checkpointing": True})
    for policy in (built.kwargs["auto_wrap_policy"], built._activation_checkpointing_kwargs["auto_wrap_policy"]):
        assert isinstance(policy, ModuleWrapPolicy) and set(policy._module_classes) == {Block}


def test_printed_config_feeds_back_as_a_config(tmp_path):
    printed = print_config("--config", str(DEMO), "--trainer.max_steps", "7")
    saved = tmp_path / "run.yaml"
    saved.write_text(printed)
    assert print_config("--config", str(saved)) == printed
    assert yaml.safe_load(printed)["trainer"]["max_steps"] == 7


def test_fit_checkpoints_validates_and_logs_to_wandb(tmp_path):
    """The demo's callbacks at intervals this short run reaches, few-shot on fewer images. (Resuming, its
    step, optimiser and schedule, is tests/train/test_runs.py's, after a SIGKILL.)"""
    callbacks = yaml.safe_load(DEMO.read_text())["trainer"]["callbacks"]
    for callback in callbacks:
        for key in ("every_n_train_steps", "every_n_steps"):
            if key in callback.get("init_args", {}):
                callback["init_args"][key] = 2
        if callback["class_path"].endswith("FewShotEvaluation"):
            callback["init_args"].update(max_train=600, max_test=100)  # room for 25 shots of each of 10 classes
    often = tmp_path / "often.yaml"
    often.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    first = mpp("fit", "--config", str(DEMO), "--config", str(often), *QUICK, "--trainer.max_steps", "4",
                run_dir=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout + first.stderr
    # The first lines say what runs, on what, and where it goes.
    assert "MaskedPatchPretraining" in out and "fashion-mnist/train-" in out and "world size 1" in out
    assert "W&B offline" in out and str(tmp_path / "checkpoints") in out
    checkpoints = tmp_path / "checkpoints"
    assert {"step0000002.ckpt", "step0000004.ckpt", "last.ckpt"} <= {p.name for p in checkpoints.iterdir()}
    saved = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and saved["encoder_config"]["patch_size"] == 4

    validated = mpp("validate", "--config", str(DEMO), *QUICK, "--ckpt_path", str(checkpoints / "last.ckpt"),
                    run_dir=tmp_path)
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert "val/mpp_accuracy" in validated.stdout and "val/majority_accuracy" in validated.stdout

    (first_run, *_) = sorted((tmp_path / "wandb").glob("offline-run-*"))
    rows = history(first_run)
    logged = set().union(*rows)
    assert {"train/loss", "train/mpp_accuracy", "train/lr", "train/throughput", "data/skipped"} <= logged
    assert {"fewshot/1shot", "fewshot/25shot"} <= logged
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    assert all(0 < loss < 10 for loss in losses)
    pictures = [row["pictures/predictions"] for row in rows if "pictures/predictions" in row]
    assert pictures and pictures[0]["_type"] == "images/separated"
    assert (first_run / "files" / pictures[0]["filenames"][0]).is_file()
    assert (tmp_path / "pictures" / "step_0000002.png").is_file()
    recorded = wandb_config(first_run)
    assert "config" in recorded and "MaskedPatchPretraining" in str(recorded["config"])


def test_credentials_reach_no_saved_config_log_checkpoint_or_wandb_record(tmp_path):
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    shards = str(ROOT / "shards" / "fashion-mnist")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=shards))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secrets = {"signature": "sig0123456789abcdef", "WANDB_API_KEY": "wandbkey0123456789abcdef0123456789abcdef",
               "AWS_SECRET_ACCESS_KEY": "awssecret0123456789"}
    signed = f"http://127.0.0.1:{server.server_address[1]}/train-{{000000..000001}}.tar?X-Amz-Signature={secrets['signature']}"
    env = environment(WANDB_API_KEY=secrets["WANDB_API_KEY"], AWS_SECRET_ACCESS_KEY=secrets["AWS_SECRET_ACCESS_KEY"])
    command = [sys.executable, "-m", "mpp", "fit", "--config", str(DEMO), *QUICK, "--trainer.max_steps", "2",
               "--data.train", signed, "--data.val", signed, "--trainer.default_root_dir", str(tmp_path)]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=time_limit(600))
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "X-Amz-Signature=***" in out, "the run summary should name the (masked) shards"
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".ckpt" for p in files) and any(p.suffix == ".wandb" for p in files)
    assert any(b"X-Amz-Signature=***" in p.read_bytes() for p in files if p.name == "config.yaml")
    for name, secret in secrets.items():
        assert secret not in out, f"{name} in the output"
        leaks = [str(p.relative_to(tmp_path)) for p in files if secret.encode() in p.read_bytes()]
        assert not leaks, f"{name} in {leaks}"
