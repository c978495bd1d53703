"""The commands of README.md and docs/*.md, taken from the pages themselves and run as written in a
user's folder, shrunk by overrides appended after them (later options win): every `mpp` line (the
Lightning runs, then the commands of mpp.commands: shards, export, evaluate, analyse) in order (the
README's first, then each doc's), the console transcripts, the
torchrun recipe of docs/distributed.md as one node of 2 CPU processes (gloo) streaming from a local
S3 server, and its SLURM recipe as 2 local processes carrying SLURM's environment, streaming from a
local GCS server. The `python -m experiments...` studies run shrunk or as their plan; the comparison
and `python -m benchmarks...` lines must be modules whose `--help` takes the options the line gives.
`make` lines set up and run everything else (the suite itself, the demo run by the slow
test_demo.py), so they are only checked to exist in the Makefile. docs/own-images.md is run by
test_own_images.py.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import pickle
import re
import runpy
import shlex
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from workspace import (
    ROOT,
    console_script,
    environment,
    fewshot_on_fewer_images,
    make_workspace,
    run,
    time_limit,
    unexplained_lines,
)

from mpp.commands import COMMANDS as MPP_COMMANDS
from mpp.commands import RUN_COMMANDS
from mpp.commands import main as mpp_main

README = (ROOT / "README.md").read_text()
# The pages whose commands run here, README first: a command's files come from the commands before it.
PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if path.name != "own-images.md"
}
SHRINK = [
    "--data.batch_size",
    "2",
    "--data.num_workers",
    "0",
    "--trainer.max_steps",
    "2",
    "--data.samples_per_epoch",
    "8",
    "--model.init_args.compile",
    "false",
    "--trainer.limit_val_batches",
    "2",
    "--trainer.limit_test_batches",
    "2",
    "--trainer.limit_predict_batches",
    "2",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.log_every_n_steps",
    "1",
]
BUCKET_SHARDS = 4  # the recipes' 4,096 shards, shrunk
# ViT-B/16's 224 and 384 px images, shrunk to 4 x 4 and 7 x 7 of its patches (tests/test_configs.py fits
# the full sizes in `make test-slow`): seconds a step on a CPU without bf16 rather than tens.
SMALL_IMAGES = {
    "configs/pretrain/vit_b16.yaml": 64,
    "configs/scratch/vit_b16.yaml": 64,
    "configs/finetune/vit_b16.yaml": 112,
}


def small_images(argv: list[str]) -> list[str]:
    """The override that shrinks the images of the ViT-B/16 recipe `argv` runs, if it runs one."""
    sizes = [SMALL_IMAGES[arg] for arg in argv if arg in SMALL_IMAGES]
    return ["--model.init_args.encoder.image_size", str(sizes[-1])] if sizes else []


KNOWN = ("mpp", "python", "torchrun", "srun", "export", "make", "#SBATCH", "#!/bin/bash")
COMMAND_BLOCKS = ("", "bash", "sh", "shell", "console")  # ```text and ```yaml blocks hold no commands


def code_blocks(text: str) -> list[list[str]]:
    """A page's fenced command blocks, each as its lines with backslash continuations joined."""
    blocks = []
    for language, block in re.findall(r"^```([a-z]*)\n(.*?)^```", text, flags=re.S | re.M):
        if language in COMMAND_BLOCKS:
            lines = re.sub(r"\\\n\s*", "", block).splitlines()
            blocks.append([line.strip() for line in lines if line.strip()])
    return blocks


def transcripts(text: str) -> list[tuple[list[str], str]]:
    """The console transcripts (blocks whose lines start with `$ `): each command and the last line it prints."""
    found: list[tuple[list[str], list[str]]] = []
    for block in code_blocks(text):
        if block[0].startswith("$ "):
            for line in block:
                if line.startswith("$ "):
                    found.append((shlex.split(line[2:]), []))
                elif line != "...":  # lines left out
                    found[-1][1].append(line)
    return [(command, output[-1]) for command, output in found]


def commands(text: str) -> list[list[str]]:
    """Every command line of every block, split as a shell would (comments dropped)."""
    found = []
    for block in code_blocks(text):
        if block[0].startswith("$ "):
            continue  # a transcript: see transcripts()
        for line in block:
            if line.startswith("#SBATCH") or line.startswith("#!"):
                found.append(line.split())
            elif not line.startswith("#") and line.split()[0] in KNOWN:
                found.append(shlex.split(line, comments=True))
    return found


def page_commands() -> list[tuple[str, list[str]]]:
    """(page, command) of every page in order; a command a later page repeats runs once, where it first stands."""
    seen: set[tuple[str, ...]] = set()
    found = []
    for page, text in PAGES.items():
        for command in commands(text):
            if command[0] in ("mpp", "python") and tuple(command) in seen:
                continue
            seen.add(tuple(command))
            found.append((page, command))
    return found


PAGE_COMMANDS = page_commands()
COMMANDS = [command for _, command in PAGE_COMMANDS]
MPP = [(page, c) for page, c in PAGE_COMMANDS if c[0] == "mpp" and c[1] not in MPP_COMMANDS]
TOOLS = [(page, c) for page, c in PAGE_COMMANDS if c[0] == "mpp" and c[1] in MPP_COMMANDS]
MODULES = [(page, c) for page, c in PAGE_COMMANDS if c[:2] == ["python", "-m"]]
# Studies that take hours as written: run shrunk or as their plan (tool_arguments). The other modules'
# lines (the comparison, the benchmarks) take minutes to hours too: their options are checked by --help.
RUN_MODULES = (
    "experiments.study",
    "experiments.curve",
    "experiments.leakage",
    "experiments.levers",
    "experiments.screen",
)


def command_id(value: object) -> str:
    return " ".join(value)[:90] if isinstance(value, list) else str(value)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_command_of_the_pages_is_one_this_file_runs() -> None:
    """A command added to the README or a doc without a way to run it here fails this test."""
    for page, text in PAGES.items():
        lines = [
            line
            for block in code_blocks(text)
            if not block[0].startswith(("mpp/", "$ "))  # but a layout
            for line in block
            if not line.startswith("#") or line.startswith("#SBATCH")
        ]
        assert not [line for line in lines if line.split()[0] not in KNOWN], page
    python = [c for c in COMMANDS if c[0] == "python"]
    assert all(c[1] == "-m" for c in python), python  # the user's commands are `mpp` commands
    assert all(c[2].startswith(("experiments.", "benchmarks.")) for _, c in MODULES)
    makefile = (ROOT / "Makefile").read_text()
    for command in (c for c in COMMANDS if c[0] == "make"):
        assert re.search(rf"^{command[1]}:", makefile, flags=re.M), f"make {command[1]} is not a Makefile target"
    assert len(MPP) >= 10 and len(TOOLS) >= 7 and len(MODULES) >= 6
    assert sum(c[0] == "torchrun" for c in COMMANDS) == 1 and sum(c[0] == "srun" for c in COMMANDS) == 1


def test_each_page_holds_what_it_promises() -> None:
    """The README's two commands, the recipes in docs/distributed.md, the failing runs in docs/robustness.md."""
    assert [c[:2] for c in commands(README) if c[0] == "make"] == [["make", "demo"], ["make", "test"]]
    # Counted in UTF-8 bytes, as a file's size is: the dashes and symbols take two or three each.
    size = len(README.encode())
    assert size <= 12_000, f"README.md is {size} bytes: move detail to docs/"
    index = len(PAGES["docs/results.md"].encode())
    assert index <= 12_000, f"docs/results.md is {index} bytes: an index, the detail on its pages"
    distributed = commands(PAGES["docs/distributed.md"])
    assert any(c[0] == "torchrun" for c in distributed) and any(c[0] == "srun" for c in distributed)
    assert len(transcripts(PAGES["docs/robustness.md"])) >= 2
    # What the README says `make demo` runs is what the Makefile's demo target runs.
    said = re.search(r"`make demo` is `python ([^`]+)`", README)
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert said and recipe and recipe.group(1).endswith(f"python {said.group(1)}"), (said, recipe)


def test_the_pages_links_lead_somewhere() -> None:
    """Every relative link of the README and docs/ names a file that exists, and a heading where it names one."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {target} does not exist"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
                assert anchor in {slug(h) for h in headings}, f"{page.name}: {target} names no heading"


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's folder, with their own images where the README's examples look for them (~)."""
    folder = make_workspace(tmp_path_factory.mktemp("user"))
    rng = np.random.default_rng(0)
    for index in range(12):
        path = folder / "photos" / ("cat", "dog", "owl")[index % 3] / f"img{index}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40, 30 + index, 3), dtype=np.uint8)).save(path)
        unlabeled = folder / "unlabeled" / f"frame{index}.png"
        unlabeled.parent.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 24), dtype=np.uint8)).save(unlabeled)
    cifar = folder / "cifar-10-batches-py"
    cifar.mkdir()
    with open(cifar / "batches.meta", "wb") as file:
        pickle.dump({b"label_names": [b"plane", b"car"]}, file)
    for name in ("data_batch_1", "test_batch"):
        with open(cifar / name, "wb") as file:
            pickle.dump({b"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8), b"labels": [0, 1] * 3}, file)
    idx = folder / "fashion-mnist-idx"  # Debian's files, small: the README line gets --dir here
    idx.mkdir()
    for stem, array in (
        ("train-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)),
        ("train-labels-idx1-ubyte", np.arange(20, dtype=np.uint8) % 10),
    ):
        header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        (idx / f"{stem}.gz").write_bytes(gzip.compress(header + array.tobytes()))
    return folder


def user_env(user: Path, **extra: str) -> dict[str, str]:
    return environment(HOME=str(user), WANDB_SILENT="false", **extra)  # wandb's console as a user sees it


def checkpoint_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def params(found: list[tuple[str, list[str]]]) -> list[object]:
    """pytest parameters of (page, command), named by both; ViT-L and larger fit in tens of seconds here:
    `make test-slow` runs them."""
    return [
        pytest.param(
            command,
            id=f"{page}: {command_id(command)}",
            marks=[pytest.mark.slow] if any(re.fullmatch(r"configs/model/vit_[lh]\.yaml", c) for c in command) else [],
        )
        for page, command in found
    ]


@pytest.mark.parametrize("command", params(MPP))
def test_mpp_commands_run_as_written(user: Path, command: list[str]) -> None:
    argv, redirect = list(command), None
    if ">" in argv:
        argv, redirect = argv[: argv.index(">")], argv[argv.index(">") + 1]
    extra = list(SHRINK)
    resume = "--ckpt_path" in argv and argv[argv.index("--ckpt_path") + 1] == "last"
    if resume:
        extra += ["--trainer.max_steps", "4"]  # two steps more than the run it resumes
    if "configs/trainer/gpu.yaml" in argv:
        extra += ["--trainer.accelerator", "cpu"]  # no GPU here; the page says so
    if not any(re.fullmatch(r"configs/model/vit_[lh]\.yaml", arg) for arg in argv):  # ViT-L/H: slow, at full size
        extra += small_images(argv)
    if "--print_config" not in argv:
        extra += fewshot_on_fewer_images(argv, user)
    result, seconds = run([console_script("mpp"), *argv[1:], *extra], user, env=user_env(user))
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    print(f"{' '.join(command)}: {seconds:.0f} s")
    if redirect:
        (user / redirect).write_text(result.stdout)
        assert "class_path: mpp.MaskedPatchPretraining" in result.stdout
        return
    if argv[1] == "fit":
        assert "mpp: global batch" in out and "mpp: checkpoint" in out
    if argv == ["mpp", "fit", "--config", "configs/pretrain/demo.yaml"]:  # the console a user sees
        others, sources = unexplained_lines(out)
        assert others == [], others  # no litlogger tip, LeafSpec or `anonymous` warning, no botocore INFO
        assert len(sources["mpp"]) == 8 and len(sources["wandb"]) >= 4, sources
    if "configs/model/vit_l.yaml" in argv:
        assert "encoder 1024x24 (16 heads)" in out
    if resume:
        assert "Restoring states from the checkpoint" in out
        assert checkpoint_step(user / "runs/demo/pretrain/checkpoints/last.ckpt") == 4
    if argv[1] == "validate":
        assert "val/mpp_accuracy" in out
    if argv[1] == "predict":  # two batches of two, the shrunk run's
        assert "mpp: predictions of 4 samples in runs/demo/" in out
    if argv[1] == "test":  # per class, named as the shards' index names them (the shrunk test set holds a few)
        names = json.loads((user / "shards/fashion-mnist/train.json").read_text())["classes"]
        shown = re.findall(r"test/accuracy/([^│┃]+?)\s*│", out)
        assert len(shown) >= 2 and set(shown) <= set(names), shown


TRANSCRIPTS = [(command, last) for text in PAGES.values() for command, last in transcripts(text)]


@pytest.mark.parametrize("command, last", TRANSCRIPTS, ids=command_id)
def test_transcripts_end_as_shown(user: Path, command: list[str], last: str) -> None:
    """The console transcripts: each command, run as shown, ends with the line shown."""
    result, _ = run([console_script("mpp"), *command[1:], *SHRINK], user, env=user_env(user))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines[-1] == last
    assert result.returncode == 2


def name(argv: list[str]) -> str:
    """What a line runs: `study` for `python -m experiments.study`, `shards-write` for `mpp shards write`."""
    if argv[0] == "mpp":
        return f"shards-{argv[2]}" if argv[1] == "shards" else argv[1]
    return argv[2].rsplit(".", 1)[-1]


def tool_arguments(argv: list[str]) -> list[str]:
    """The tiny-input changes a line needs here: Debian's FashionMNIST files are not installed."""
    tool = name(argv)
    if "fashion-mnist" in argv and tool == "shards-write":
        return ["--dir", "fashion-mnist-idx", "--limit", "20"]
    if tool == "evaluate":
        return ["--max-train", "500", "--max-test", "200", "--num-workers", "0"]
    if tool == "study":  # --full needs Debian's FashionMNIST: what it would run, then
        if "--plan" in argv or "--full" in argv:
            return ["--plan"]
        # Two arms of the plan (all of them: tests/test_study.py's slow run), with their paired difference.
        return [
            "--quick",
            "--budgets",
            "1000",
            "--no-ablation",
            "--no-hybrid",
            "--seeds",
            "2",
            "--arms",
            "scratch",
            "mpp",
            "--out",
            "runs/study-readme",
        ]
    if tool == "curve":  # the embedded sample, one budget of 4 steps, 2 seeds; --plan as it is
        return (
            ["--plan"]
            if "--plan" in argv
            else ["--quick", "--budgets", "4", "--no-supervised", "--out", "runs/curve-readme"]
        )
    if tool == "leakage":
        return ["--quick", "--out", "runs/leakage-readme"]
    if tool == "screen":  # the embedded sample, a few steps, a lever of each kind; --plan as it is
        return ["--plan"] if "--plan" in argv else ["--quick", "--out", "runs/screen-readme"]
    if tool == "levers":  # hours of runs: what each lever's study would run (run quick: test_levers)
        return ["--plan"]
    return []


def check_output(user: Path, argv: list[str], stdout: str) -> None:
    """What a line's output must show, and the files it must leave."""
    tool = name(argv)
    if tool == "shards-write":
        out = Path(argv[argv.index("--out") + 1])
        assert any((user / out).glob("*.json")), stdout
    if "--holdout" in argv:
        assert (user / "shards/photos-split/val.json").is_file() and (user / "shards/photos-split/train.json").is_file()
    if tool == "shards-inspect":
        assert "verified: 12 samples" in stdout
    if tool == "study":
        shown = {
            "--full": "in all: 40 runs, 14,000 optimiser steps",
            "--plan": "in all: 125 runs, 46,200 optimiser steps",
        }
        expected = next(
            (line for flag, line in shown.items() if flag in argv), "| MPP pretrained, fine-tuned − from scratch |"
        )
        assert expected in stdout
    if tool == "study" and "--results" in argv and "--full" not in argv:
        assert (user / argv[argv.index("--results") + 1] / "study.json").is_file()
    if tool == "curve" and "--plan" in argv:
        assert "pretrain: 9 runs, 37,800 steps" in stdout and "b1000/scratch: 16 runs, 58,400 steps" in stdout
    elif tool == "curve":
        assert re.search(r"^\| 4 \| \d+\.\d ± \d+\.\d \[", stdout, re.M), stdout[-3000:]
        assert "MPP fine-tuned − from scratch, plateau: " in stdout
        assert "- Hybrid from scratch − from scratch, each at its plateau: " in stdout, stdout[-3000:]
        written = {path.name for path in (user / argv[argv.index("--results") + 1]).iterdir()}
        assert written == {"curve.json", "curve.md", "curve.png", "ledger.json"}
    if tool == "leakage":
        assert "| hybrid, mask_pixels | frozen |" in stdout and "hybrid - vit, frozen: " in stdout
        assert (user / argv[argv.index("--results") + 1] / "leakage.json").is_file()
    if tool == "screen" and "--plan" in argv:
        assert "mpp: steps: 500 / 1100 / 2900 / 10100 (in order)" in stdout and "scratch: fits: 9 runs" in stdout
    elif tool == "screen":
        assert "| mpp | ratio | 0.5 | " in stdout and "The screen has ended." in stdout, stdout[-3000:]
        # then its confirmation: each final run and frozen encoder read the test set once, after the choices
        assert re.search(r"^\| MPP pretrained 8 steps \| .* \| 2 \| ", stdout, re.M), stdout[-3000:]
        assert "Test set: read 6 times, by 6 of the 6 final evaluations" in stdout and "each after its point's choice" in stdout
        written = {path.name for path in (user / argv[argv.index("--results") + 1]).iterdir()}
        assert written == {"screen.json", "screen.md", "ledger.json"}
    if tool == "levers":
        assert "levers: wide: a wider encoder" in stdout and "in all: 23 runs, 12,700 optimiser steps" in stdout
    if tool == "evaluate":
        assert "(500 train / 200 test images" in stdout and re.search(r"^\| 25 \| \d+\.\d%", stdout, re.M)


@pytest.mark.parametrize("command", params(TOOLS))
def test_tool_commands_run_as_written(user: Path, command: list[str]) -> None:
    argv = [str(Path(c).expanduser()) if c.startswith("~") else c for c in command]
    argv = [arg.replace(str(Path.home()), str(user)) for arg in argv]
    result, _ = run([console_script("mpp"), *argv[1:], *tool_arguments(argv)], user, env=user_env(user))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    check_output(user, argv, result.stdout)


PYTHON_BLOCKS = [
    (page, block)
    for page, text in PAGES.items()
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
]


@pytest.mark.parametrize(("page", "block"), PYTHON_BLOCKS, ids=[page for page, _ in PYTHON_BLOCKS])
def test_python_blocks_run_as_written(user: Path, page: str, block: str) -> None:
    """A page's Python lines (reading what its commands wrote) run as written, after those commands."""
    result, _ = run([sys.executable, "-c", block], user, env=user_env(user))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("command", params([(page, c) for page, c in MODULES if c[2] in RUN_MODULES]))
def test_study_commands_run_shrunk(user: Path, command: list[str]) -> None:
    """The studies as the pages write them, from the checkout (experiments/ is not installed), shrunk."""
    pythonpath = os.pathsep.join([str(ROOT), environment()["PYTHONPATH"]])
    argv = [sys.executable, "-m", command[2], *command[3:], *tool_arguments(command)]
    result, _ = run(argv, user, env=user_env(user, PYTHONPATH=pythonpath))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    check_output(user, command, result.stdout)
    if name(command) == "curve" and "--results" in command:  # a fresh checkout: the committed results go on
        again, _ = run([*argv, "--out", "runs/curve-elsewhere"], user, env=user_env(user, PYTHONPATH=pythonpath))
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
        assert "finished runs restored from" in again.stdout and "study: start" not in again.stdout, again.stdout
        table = [line for line in result.stdout.splitlines() if line.startswith("| 4 |")]
        assert table and table == [line for line in again.stdout.splitlines() if line.startswith("| 4 |")]


@pytest.fixture(scope="module")
def usage() -> Callable[[str], str]:
    """`python -m <module> --help` of a module of the checkout, run as __main__ in this process, once each."""
    seen: dict[str, str] = {}

    def usage_of(module: str) -> str:
        if module not in seen:
            with pytest.MonkeyPatch.context() as patch:
                patch.syspath_prepend(str(ROOT))
                patch.setattr(sys, "argv", [module, "--help"])
                out = io.StringIO()
                with pytest.raises(SystemExit) as exit_, contextlib.redirect_stdout(out):
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                assert exit_.value.code in (0, None), module
            seen[module] = out.getvalue()
        return seen[module]

    return usage_of


@pytest.mark.parametrize("command", params([(page, c) for page, c in MODULES if c[2] not in RUN_MODULES]))
def test_module_commands_take_the_options_shown(usage: Callable[[str], str], command: list[str]) -> None:
    """The comparison and benchmark lines run minutes to hours: each names a module of the checkout
    whose `--help` parses and lists every option the line gives."""
    text = usage(command[2])
    assert text.startswith("usage:"), text[:500]
    options = [arg.split("=", 1)[0] for arg in command[3:] if arg.startswith("--")]
    assert [option for option in options if not re.search(rf"{re.escape(option)}\b", text)] == [], text


SOURCES = ("folder", "flat", "fashion-mnist", "cifar")
HELPS = [
    ["shards"],
    ["shards", "write"],
    *(["shards", "write", source] for source in SOURCES),
    ["shards", "inspect"],
    ["export"],
    ["evaluate"],
    ["analyse"],
]


@pytest.mark.parametrize("command", HELPS, ids=" ".join)
def test_every_command_says_how_to_use_it(command: list[str], capsys) -> None:
    """`mpp <command> --help` prints its usage and exits 0; `--bogus` is one error line and exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        mpp_main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mpp {' '.join(command)}"), out[:200]
    with pytest.raises(SystemExit) as exit_:
        mpp_main([*command, "--bogus"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("mpp: error: ")


def test_mpp_help_lists_every_command(user: Path) -> None:
    """`mpp --help` names the Lightning runs and every command of mpp.commands, with what each does; an
    unknown command is one line naming them."""
    result, _ = run([console_script("mpp"), "--help"], user, env=user_env(user))
    assert result.returncode == 0, result.stderr
    for command, what in [*RUN_COMMANDS.items(), *((c, about) for c, (_, about) in MPP_COMMANDS.items())]:
        assert re.search(rf"^  {command} +{re.escape(what)}$", result.stdout, re.M), command
    result, _ = run([console_script("mpp"), "pretrain"], user, env=user_env(user))
    assert result.returncode == 2 and result.stderr == (
        "mpp: error: no command pretrain: mpp's commands are fit, validate, test, predict, shards, export, evaluate, "
        "analyse; `mpp --help` says what each does\n"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def recipe(command: list[str], *, after: str) -> list[str]:
    """The arguments of the `mpp` part of a recipe, from `after` on, shrunk to 1 node x 2 CPU processes."""
    args = command[command.index(after) + 1 :]
    train = args[args.index("--data.train") + 1]
    shrunk = re.sub(r"\{000000\.\.\d+\}", f"{{000000..{BUCKET_SHARDS - 1:06d}}}", train)
    return [
        *args,
        "--trainer.num_nodes",
        "1",
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        *SHRINK,
        *small_images(args),
        "--data.train",
        shrunk,
    ]


def bucket_keys(command: list[str]) -> tuple[str, list[str]]:
    """(bucket, object names) of a recipe's shrunk --data.train URL."""
    url = command[command.index("--data.train") + 1]
    bucket, _, path = url.split("://", 1)[1].partition("/")
    folder, name = path.rsplit("/", 1)
    prefix = name.split("-{", 1)[0]
    return bucket, [f"{folder}/{prefix}-{i:06d}.tar" for i in range(BUCKET_SHARDS)]


def shard_bytes(user: Path, index: int) -> bytes:
    return (user / "shards" / "my-images" / f"train-{index:06d}.tar").read_bytes()


@pytest.fixture
def s3(user: Path) -> Iterator[dict[str, str]]:
    """A local S3 server holding the torchrun recipe's bucket, and the AWS profile the recipe exports."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    (user / ".aws").mkdir(exist_ok=True)
    (user / ".aws" / "config").write_text(f"[profile training]\nregion = us-east-1\nendpoint_url = {endpoint}\n")
    (user / ".aws" / "credentials").write_text(
        "[training]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
    )
    torchrun = next(c for c in COMMANDS if c[0] == "torchrun")
    bucket, keys = bucket_keys(recipe(torchrun, after="fit"))
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=bucket)
    for index, key in enumerate(keys):
        client.put_object(Bucket=bucket, Key=key, Body=shard_bytes(user, index))
    yield {
        "AWS_CONFIG_FILE": str(user / ".aws" / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(user / ".aws" / "credentials"),
    }
    server.stop()


def test_readme_torchrun_recipe_on_one_node_of_two_cpu_processes(user: Path, s3: dict[str, str]) -> None:
    exported = dict(c[1].split("=", 1) for c in COMMANDS if c[0] == "export")
    command = next(c for c in COMMANDS if c[0] == "torchrun")
    launcher = command[1 : command.index("-m")]
    values = {
        "--nnodes": "1",
        "--nproc-per-node": "2",
        "--node-rank": "0",
        "--master-addr": "127.0.0.1",
        "--master-port": str(free_port()),
    }
    for index, arg in enumerate(launcher):
        if arg in values:
            launcher[index + 1] = values[arg]
    argv = [console_script("torchrun"), *launcher, "-m", "mpp", "fit", *recipe(command, after="fit")]
    result, seconds = run(argv, user, env=user_env(user, **exported, **s3))
    assert result.returncode == 0, result.stderr[-5000:]
    out = result.stdout + result.stderr
    print(f"torchrun recipe: {seconds:.0f} s")
    assert "world size 2 (1 node(s) x 2 device(s))" in out
    assert "global batch 4 = 1 node(s) x 2 device(s) x batch 2 x 1 accumulated; peak lr 1.953e-07" in out
    assert checkpoint_step(user / "runs/vit_b16_mpp/checkpoints/last.ckpt") == 2


@pytest.fixture
def gcs(user: Path) -> Iterator[dict[str, str]]:
    """A local GCS server holding the SLURM recipe's bucket."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read as gcsfs is imported: no gRPC probe
    import gcsfs
    from gcp_storage_emulator.server import create_server

    srun = next(c for c in COMMANDS if c[0] == "srun")
    bucket, keys = bucket_keys(recipe(srun, after="fit"))
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True)
    for index, key in enumerate(keys):
        fs.pipe(f"{bucket}/{key}", shard_bytes(user, index))
    yield {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    server.stop()


def test_readme_slurm_recipe_as_two_local_tasks(user: Path, gcs: dict[str, str]) -> None:
    sbatch = {c[1]: c[2] for c in COMMANDS if c[0] == "#SBATCH" and len(c) > 2}
    assert sbatch["--nodes"] == "4" and sbatch["--ntasks-per-node"] == "8"  # shrunk to 1 node x 2 tasks below
    command = next(c for c in COMMANDS if c[0] == "srun")
    assert command[1] == "mpp"
    # The recipe resumes (`--ckpt_path last`), as a requeued job does: from the torchrun recipe's run.
    argv = [console_script("mpp"), "fit", *recipe(command, after="fit"), "--trainer.max_steps", "4"]
    port = str(free_port())
    tasks = []
    for rank in range(2):
        slurm = {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NAME": "mpp",
            "SLURM_JOB_ID": "4242",
            "SLURM_NODELIST": "127.0.0.1",
            "MASTER_PORT": port,
        }
        tasks.append(
            subprocess.Popen(
                argv,
                cwd=user,
                env=user_env(user, **slurm, **gcs),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [task.communicate(timeout=time_limit(400))[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "world size 2 (1 node(s) x 2 device(s))" in outputs[0]
    assert "Restored all states from the checkpoint" in outputs[0]
    assert checkpoint_step(user / "runs/vit_b16_mpp/checkpoints/last.ckpt") == 4
