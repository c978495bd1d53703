"""What a user reads: a failed run ends in one line (what is wrong, the key or URL, what to do) and
an exit code, the traceback only on request; `mpp --help` says what mpp is. (The console of a
good run is checked on the README's demo command, in test_readme.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from workspace import ROOT, console_script, environment, make_workspace, run, time_limit

from mpp.cli import main

DEMO = str(ROOT / "configs" / "pretrain" / "demo.yaml")
# A run small enough to start in seconds, on the demo's shards, without W&B.
SMALL = ["--data.batch_size", "8", "--data.num_workers", "0", "--trainer.max_steps", "2", "--trainer.logger", "false",
         "--trainer.enable_model_summary", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.limit_val_batches", "1"]


def console(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[int, list[str]]:
    """`mpp` in this process -> (exit code, the lines it printed on stdout and stderr)."""
    monkeypatch.setattr(sys, "argv", ["mpp"])  # pytest's own arguments are not the command's
    with pytest.raises(SystemExit) as exit_:
        main(args)
    out, err = capfd.readouterr()
    return exit_.value.code, [line for line in (out + err).splitlines() if line.strip()]


@pytest.mark.parametrize("override, line", [
    (["--model.init_args.corruption.ratio", "1.5"], "corruption.ratio must be in (0, 1], got 1.5"),
    (["--model.init_args.corruption.mask", "0.7"],
     "corruption.mask + corruption.random + corruption.keep must sum to 1, got 0.9 (0.7 + 0.1 + 0.1)"),
    (["--model.init_args.encoder.patch_size", "5"],
     "encoder.patch_size 5 must divide encoder.image_size 28 (height 28 is not a multiple of 5)"),
    (["--model.init_args.optimizer.lr", "fast"], "model.init_args.optimizer.lr: Expected a float. Got value: fast"),
    (["--model.init_args.encoder.dimm", "3"],
     "unknown option model.init_args.encoder.dimm: `mpp fit --model.help mpp.MaskedPatchPretraining` lists the options"),
    (["--data.batch_sise", "3"], "unknown option data.batch_sise: `mpp fit --help` lists the options"),
    (["--ckpt_path", "README.md"], "--ckpt_path README.md is not a checkpoint (a file written by torch.save, such as "
                                   "checkpoints/last.ckpt); give a .ckpt file, or `last`"),
    (["--ckpt_path", "no.ckpt"], "--ckpt_path no.ckpt does not exist; give a .ckpt file, or `last` to resume from "
                                 "the run folder's last checkpoint"),
])
def test_a_bad_config_is_one_line_and_exit_code_2(override, line, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    code, lines = console(capfd, monkeypatch, ["fit", "--config", DEMO, *override, "--trainer.default_root_dir", str(tmp_path)])
    assert code == 2
    assert lines[-1] == f"mpp: error: {line}"
    assert lines[:-1] in ([], ["Seed set to 0"]), lines  # before instantiation Lightning seeds, and says so
    assert not (tmp_path / "checkpoints").exists()


def test_the_traceback_is_there_on_request(capfd, monkeypatch):
    with pytest.raises(ValueError, match=r"corruption\.ratio must be in"):
        main(["fit", "--config", DEMO, "--model.init_args.corruption.ratio", "1.5", "--traceback"])
    monkeypatch.setenv("MPP_DEBUG", "1")
    with pytest.raises(ValueError, match=r"corruption\.ratio must be in"):
        main(["fit", "--config", DEMO, "--model.init_args.corruption.ratio", "1.5"])


def _empty_tar(path: Path) -> str:
    tarfile.open(path, "w").close()
    return str(path)


def _shards_and_endpoints(tmp_path: Path) -> dict[str, tuple[list[str], dict[str, str], str, int]]:
    """Each runtime failure: (options, environment, the last line's pattern, exit code)."""
    closed = "127.0.0.1:9"  # the discard port: nothing listens there
    retries = {"MPP_READ_RETRIES": "0"}
    (tmp_path / "zero.tar").write_bytes(b"")
    return {
        "folder": (["--data.train", "shards/fashion-mnist"], {}, re.escape(
            "data.train: shard shards/fashion-mnist is a folder, not a tar file: give its shards as a pattern, e.g. "
            "'shards/fashion-mnist/test-000000.tar' or 'shards/fashion-mnist/train-{000000..000009}.tar'"), 2),
        # Read by a DataLoader worker, whose error torch re-raises with the worker's traceback in its message.
        "http": (["--data.train", f"http://{closed}/train-{{000000..000001}}.tar", "--data.num_workers", "1"], retries, re.escape(
            f"cannot open http://{closed}/train-00000") + r"\d\.tar: URLError: .*Connection refused.*; gave up after 1 "
            r"attempt in \d+ s \(MPP_READ_RETRIES=0, .*\)", 1),
        "s3": (["--data.train", "s3://bucket/train-{000000..000001}.tar", "--data.num_workers", "1"],
               {**retries, "AWS_ENDPOINT_URL": f"http://{closed}", "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"},
               r"cannot open s3://bucket/train-00000\d\.tar: EndpointConnectionError: .*; gave up after 1 attempt", 1),
        "empty tar, resampled": (["--data.train", _empty_tar(tmp_path / "empty.tar")], {}, re.escape(
            f"every shard this stream draws from is empty (a tar with no members): {tmp_path}/empty.tar; there is "
            "nothing to train on. Check them with `mpp shards inspect <shards>`"), 1),
        "empty tar": (["--data.train", str(tmp_path / "empty.tar"), "--data.resampled", "false"], {}, re.escape(
            f"data.train yielded no batch: its 1 shard(s) ({tmp_path}/empty.tar) hold no sample"), 1),
        "zero-byte validation tar": (["--data.val", str(tmp_path / "zero.tar")], {}, re.escape(
            f"data.val yielded no batch: its 1 shard(s) ({tmp_path}/zero.tar) hold no sample"), 1),
    }


@pytest.mark.parametrize("case", ["folder", "http", "s3", "empty tar, resampled", "empty tar",
                                  "zero-byte validation tar"])
def test_a_failing_run_ends_in_one_line_without_traceback(case, capfd, monkeypatch, tmp_path):
    options, env, pattern, exit_code = _shards_and_endpoints(tmp_path)[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    code, lines = console(capfd, monkeypatch, ["fit", "--config", DEMO, *SMALL, *options,
                                  "--trainer.default_root_dir", str(tmp_path / "run")])
    assert code == exit_code
    assert re.match(pattern, lines[-1].removeprefix("mpp: error: ")), lines[-1]
    assert lines[-1].startswith("mpp: error: ")
    text = "\n".join(lines)
    assert "Traceback" not in text and "Found credentials" not in text
    # Lightning's three lines (seed, GPU, TPU), mpp's summary, perhaps the first skip's warning, and the error.
    assert len(lines) <= 11, text


def test_an_unreachable_bucket_on_gcs_ends_in_one_line(tmp_path):
    # gcsfs's own 6 tries with backoff, under mpp's, took minutes; mpp's retries are the only ones now.
    folder = make_workspace(tmp_path / "work")
    env = environment(STORAGE_EMULATOR_HOST="http://127.0.0.1:9", GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
                      MPP_READ_RETRIES="0")
    command = [console_script("mpp"), "fit", "--config", "configs/pretrain/demo.yaml", *SMALL,
               "--data.train", "gs://bucket/train-{000000..000001}.tar"]
    result, _ = run(command, folder, env=env)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 1
    assert re.fullmatch(r"mpp: error: cannot open gs://bucket/train-00000\d\.tar: ClientConnectorError: Cannot "
                        r"connect to host 127\.0\.0\.1:9 .*; gave up after 1 attempt .*", lines[-1]), lines[-1]
    assert "Traceback" not in result.stdout + result.stderr and len(lines) <= 11, lines


@pytest.mark.slow  # the same path as test_data's worker stopped by SIGTERM, through a whole run (10 s)
def test_a_run_stopped_by_sigterm_says_so(tmp_path):
    """SIGTERM to the process group (a scheduler's stop, `timeout`) while the workers read: the run
    says it was stopped and exits 143, rather than blaming the out-of-memory killer."""
    folder = make_workspace(tmp_path / "work")
    command = [console_script("mpp"), "fit", "--config", "configs/pretrain/demo.yaml", "--trainer.max_steps", "1000",
               "--data.batch_size", "16", "--data.num_workers", "2", "--trainer.enable_progress_bar", "false",
               "--trainer.num_sanity_val_steps", "0"]
    process = subprocess.Popen(command, cwd=folder, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + time_limit(120)
    while not list((folder / "runs").glob("demo/pretrain/wandb/offline-run-*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # training, its workers reading
    os.killpg(process.pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=time_limit(120))
    lines = [line for line in out.splitlines() if line.strip()]
    assert process.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert re.fullmatch(r"mpp: (error: the run was stopped by SIGTERM, which also stopped its DataLoader workers "
                        r"\(worker \d \(pid \d+\) .*\)|stopped by SIGTERM); (resume with --ckpt_path last|no checkpoint in "
                        r"\S+ to resume from: running it again starts at step 0)", lines[-1]), out
    assert "out-of-memory" not in out and "Traceback" not in out


def test_mpp_introduces_itself(capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capfd.readouterr().out
    assert "masked patch prediction for Vision Transformers" in text
    assert "Lightning Trainer command line tool" not in text
    for config in sorted((ROOT / "configs").glob("*/*.yaml")):
        if config.parent.name != "model":
            assert f"configs/{config.parent.name}/{config.name}" in text
    # The size presets in one line, small to large, each hybrid after its ViT.
    assert "configs/model/vit_{demo,demo_hybrid,ti,s,b,b_r50,l,h}.yaml" in text
    assert sorted((ROOT / "configs/model").glob("*.yaml")) == sorted(
        ROOT / "configs/model" / f"vit_{size}.yaml" for size in ["demo", "demo_hybrid", "ti", "s", "b", "b_r50", "l", "h"])
    for command in ("mpp fit --config configs/pretrain/demo.yaml", "mpp fit --config configs/finetune/demo.yaml",
                    "mpp fit --config configs/scratch/demo.yaml", "--model.help"):
        assert command in text
    assert "experiments" not in text  # the laboratory is not installed with the package
