"""A user's folder for whole-run tests: the project's configs and embedded shards, plus tiny shards
at every path the shipped configs, the README and docs/ name, so their commands run unchanged there.

Commands run with this folder as their working directory, so every relative path they write
(`runs/...`, `shards/...`, `my_run.yaml`) lands inside it.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import yaml
from shardkit import sample, write_shard

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent
# A run's environment as on a CPU without bf16, on any machine: oneDNN and ATen held to AVX2, so that
# bf16 would be emulated there, and mpp.precision says so (float32 is what such a run takes).
NO_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

# One float32 forward and backward of a small transformer layer on one thread, the best of 5, on the
# 2-core Intel Xeon (AMX) where the tests' time limits hold with a margin: 0.06 s with nothing else
# running; 0.1 leaves room for the other test worker's runs.
REFERENCE_SECONDS = 0.1

# Shard sets the shipped configs, the README and docs/ name by default: (folder, prefix, shards, labelled).
DEFAULT_SHARDS = [("my-images", "train", 1024, False), ("imagenet", "train", 1024, True), ("imagenet", "val", 64, True)]


def mpp_command(*argv: str) -> int:
    """`mpp <command> ...` of mpp.commands (shards, export, evaluate, analyse) run in this process, as the
    console script runs it -> its exit code; what it prints goes to this process's stdout and stderr."""
    from mpp.commands import run_command

    return run_command(list(argv))


def help_of(module: str, monkeypatch, capsys) -> str:
    """`python -m <module> --help`, run as __main__ in this process -> what it printed (a usage)."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"{module} --help exited {exit_.code}"
    return capsys.readouterr().out


def make_workspace(folder: Path) -> Path:
    """`folder` set up as the project's checkout, with the default shard sets of the ViT-B/16 configs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "configs").symlink_to(ROOT / "configs")
    (folder / "shards").mkdir()
    (folder / "shards" / "fashion-mnist").symlink_to(ROOT / "shards" / "fashion-mnist")
    for name, prefix, count, labelled in DEFAULT_SHARDS:
        target = folder / "shards" / name
        target.mkdir(exist_ok=True)
        for index in range(count):  # one tiny photo each: the configs' crops upscale it
            write_shard(target / f"{prefix}-{index:06d}.tar", [sample(index, labelled=labelled, size=(20, 16))])
    return folder


@cache
def slowdown() -> float:
    """How many times slower than the reference machine this one runs the tests' float32 work, at least 1:
    MPP_TEST_SLOWDOWN where set, else measured here (REFERENCE_SECONDS) on one thread, as a test worker runs."""
    if os.environ.get("MPP_TEST_SLOWDOWN"):
        return max(1.0, float(os.environ["MPP_TEST_SLOWDOWN"]))
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # the test that asked goes on drawing what it would have
            torch.manual_seed(0)
            layer = torch.nn.TransformerEncoderLayer(192, 3, 768, batch_first=True)
            tokens = torch.randn(16, 65, 192)
            best = float("inf")
            for _ in range(5):  # its dropout draws too
                start = time.perf_counter()
                layer(tokens).square().mean().backward()
                best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return max(1.0, best / REFERENCE_SECONDS)


def time_limit(seconds: float) -> float:
    """A time limit set on the reference machine, for a run on this one: `seconds` x slowdown(), so that a
    slower CPU (no AVX-512, an emulated one) waits as much longer as its runs take."""
    return seconds * slowdown()


def environment(**extra: str) -> dict[str, str]:
    """The environment of a run: W&B offline, no credentials of this machine, the tests' probes importable."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("WANDB_", "AWS_", "SLURM_", "GOOGLE_"))
    }
    env.update(
        {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
    )
    env.update(extra)
    return env


def fewshot_on_fewer_images(argv: list[str], cwd: Path) -> list[str]:
    """Overrides that give the few-shot evaluation of `mpp fit` `argv` (run in `cwd`) fewer images to read
    where its configs end their callbacks with it (`--trainer.callbacks.init_args.*` sets the list's last):
    600 training images, room for 25 shots of each of 10 classes, and 100 test images, not 2,000 and
    all of data.val twice (at the first step and the last). Nothing for a run that adds callbacks itself."""
    if argv[:2] != ["mpp", "fit"] or any(arg.startswith("--trainer.callbacks") for arg in argv):
        return []
    callbacks: list = []
    for index, arg in enumerate(argv[:-1]):
        if arg == "--config":
            config = yaml.safe_load((cwd / argv[index + 1]).read_text()) or {}
            callbacks = (config.get("trainer") or {}).get("callbacks", callbacks) or []
    if not callbacks or not str(callbacks[-1].get("class_path", "")).endswith("FewShotEvaluation"):
        return []
    return ["--trainer.callbacks.init_args.max_train", "600", "--trainer.callbacks.init_args.max_test", "100"]


def console_script(name: str) -> str:
    """An installed console script (`mpp`, `torchrun`) of this environment."""
    return str(Path(sys.executable).parent / name)


def run(
    argv: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 400
) -> tuple[subprocess.CompletedProcess, float]:
    """Run a command in the workspace -> (result, seconds); `timeout` is a reference machine's (time_limit)."""
    start = time.monotonic()
    result = subprocess.run(
        argv, cwd=cwd, env=env or environment(), capture_output=True, text=True, timeout=time_limit(timeout)
    )
    return result, time.monotonic() - start


def unexplained_lines(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """A run's console -> (the lines that neither mpp, Lightning nor wandb wrote, each source's lines).

    The progress bar redraws with carriage returns: each line's last drawing is what stays on screen.
    """
    lines = [line.split("\r")[-1] for line in out.splitlines()]
    lines = [
        line
        for line in lines
        if re.sub(r"\x1b\[\w", "", line).strip()
        and not re.match(r"\s*(Epoch \d+|Validation|Sanity|Training|Testing)", line)
    ]
    sources = {
        "mpp": [line for line in lines if line.startswith("mpp: ")],
        "wandb": [line for line in lines if re.match(r"(\x1b\[[\d;]*m)?wandb", line)],
        "lightning": [
            line
            for line in lines
            if re.match(
                r"(Seed set|GPU available|TPU available|Using bfloat16 Automatic|`Trainer.fit` stopped|Restoring states|"
                r"Restored all states|\s*\||\d+ |-{10,}|\s*\d+\.\d+ +Total)",
                line,
            )
        ],
    }
    known = {line for group in sources.values() for line in group}
    return [line for line in lines if line not in known], sources
