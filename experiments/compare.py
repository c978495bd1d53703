"""Does masked patch prediction help? Pretrain, then fine-tune the pretrained encoder next to
the same classifier trained from scratch — same labels, augmentation, steps and evaluation —
and write a markdown table and a plot of validation accuracy against step. The table scores every
encoder frozen too (the pretrained one and both arms'): few-shot, k-NN and linear probe.

    python -m experiments.compare   # the demo configs, embedded sample
    python -m experiments.compare --pretrained runs/demo/pretrain/checkpoints/last.ckpt \\
        --train shards/fashion-mnist/train-000000.tar --out runs/compare-1k   # 1,000 labels
    python -m experiments.compare --test shards/fashion-mnist/test-000000.tar 'full=shards/fmnist-full/test-000000.tar'

Each run is an `mpp fit` / `mpp test` subprocess with its own folder under --out; results are
read back from the runs' W&B records, so finished runs can be inspected or synced later.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mpp.config import read_config  # noqa: E402
from mpp.eval.frozen import FrozenScores, evaluate_checkpoint  # noqa: E402
from mpp.eval.linear import DEFAULTS  # noqa: E402
from mpp.outputs.wandb_records import history  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"finetune": "MPP pretrained, fine-tuned", "scratch": "from scratch"}


def mpp(*args: str) -> float:
    """Run the `mpp` command in a subprocess, stream its output, return its wall time in seconds."""
    command = [sys.executable, "-m", "mpp", *args]
    print("+ mpp " + " ".join(args[:3]) + " ...", flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.perf_counter() - start


def last_run(folder: Path) -> Path:
    """The newest W&B run folder under a run's root."""
    runs = sorted((folder / "wandb").glob("*-run-*"))
    if not runs:
        raise FileNotFoundError(f"no W&B run under {folder}/wandb")
    return runs[-1]


def curve(folder: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of a metric over a fit."""
    return [(int(r["trainer/global_step"]) + 1, r[metric]) for r in history(last_run(folder)) if metric in r]


def logged(folder: Path, metric: str) -> float:
    """The last value of a metric in a run."""
    values = [row[metric] for row in history(last_run(folder)) if metric in row]
    if not values:
        raise KeyError(f"{metric} was not logged in {last_run(folder)}")
    return values[-1]


def parse_tests(specs: list[str]) -> dict[str, str]:
    """["name=spec" or "spec", ...] -> {name: shard spec}."""
    tests = {}
    for index, spec in enumerate(specs):
        name, sep, shards = spec.partition("=")
        named = sep and not any(c in name for c in "/:{")
        tests[name if named else f"test{index}"] = shards if named else spec
    return tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain", default="configs/pretrain/demo.yaml", help="pretraining run config")
    parser.add_argument("--finetune", default="configs/finetune/demo.yaml", help="fine-tuning run config")
    parser.add_argument("--scratch", default="configs/scratch/demo.yaml", help="from-scratch run config")
    parser.add_argument("--pretrained", help="an existing pretraining checkpoint (skips pretraining)")
    parser.add_argument("--train", help="labelled training shards for both arms (default: the configs')")
    parser.add_argument(
        "--test",
        nargs="+",
        default=["sample=shards/fashion-mnist/test-000000.tar"],
        help="test shard specs, optionally named as name=spec",
    )
    parser.add_argument("--steps", type=int, help="training steps of both arms (default: the configs')")
    parser.add_argument("--pretrain-steps", type=int, help="pretraining steps (default: the config's)")
    # The table's few-shot columns; everything else about the evaluation is mpp.eval.linear.DEFAULTS.
    parser.add_argument("--shots", type=int, nargs="+", default=[10, 25], help="few-shot columns")
    parser.add_argument(
        "--frozen-train",
        type=int,
        default=2000,
        help="labelled training images the frozen encoders' k-NN and linear probe learn from (the first ones, "
        "in shard order; the demo pretraining's few-shot callback takes the same 2,000)",
    )
    parser.add_argument("--out", default="runs/compare", help="folder for every run, the table and the plot")
    args = parser.parse_args(argv)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = parse_tests(args.test)
    os.environ.setdefault("WANDB_SILENT", "true")

    wall: dict[str, float] = {}
    pretrained = args.pretrained
    if pretrained is None:
        limit = ["--trainer.max_steps", str(args.pretrain_steps)] if args.pretrain_steps else []
        wall["pretrain"] = mpp(
            "fit", "--config", args.pretrain, "--trainer.default_root_dir", str(out / "pretrain"), *limit
        )
        pretrained = str(out / "pretrain" / "checkpoints" / "last.ckpt")

    for arm in ARMS:
        config = getattr(args, arm)
        overrides = ["--trainer.default_root_dir", str(out / arm)]
        overrides += ["--data.train", args.train] if args.train else []
        overrides += ["--trainer.max_steps", str(args.steps)] if args.steps else []
        overrides += ["--model.init_args.pretrained", pretrained] if arm == "finetune" else []
        wall[arm] = mpp("fit", "--config", config, *overrides)
        checkpoint = str(out / arm / "checkpoints" / "last.ckpt")
        for name, spec in tests.items():  # later options win: each test run gets its own folder
            mpp(
                "test",
                "--config",
                config,
                *overrides,
                "--ckpt_path",
                checkpoint,
                "--data.test",
                spec,
                "--trainer.default_root_dir",
                str(out / arm / f"test-{name}"),
            )

    fewshot_train = args.train or read_config(ROOT / args.finetune)["data"]["train"]  # the arms' labelled shards
    first_test = next(iter(tests.values()))
    evaluation = replace(DEFAULTS, shots=tuple(args.shots), max_train=args.frozen_train)
    frozen = {
        key: evaluate_checkpoint(path, train=fewshot_train, test=first_test, settings=evaluation)
        for key, path in {
            "pretrained": pretrained,
            **{arm: str(out / arm / "checkpoints" / "last.ckpt") for arm in ARMS},
        }.items()
    }

    results = {arm: {name: logged(out / arm / f"test-{name}", "test/accuracy") for name in tests} for arm in ARMS}
    steps = {arm: torch.load(out / arm / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] for arm in ARMS}
    table = render(results, frozen, steps, wall, tests, args)
    (out / "comparison.md").write_text(table + "\n")
    numbers = {
        "test_accuracy": results,
        "fewshot": {key: scores.fewshot for key, scores in frozen.items()},
        "knn": {key: scores.knn for key, scores in frozen.items()},
        "linear": {key: scores.linear for key, scores in frozen.items()},
        "linear_l2": {key: scores.linear_l2 for key, scores in frozen.items()},
        "steps": steps,
        "wall_seconds": wall,
    }
    (out / "comparison.json").write_text(json.dumps(numbers, indent=2))
    plot({ARMS[arm]: curve(out / arm, "val/accuracy") for arm in ARMS}, out / "comparison.png")
    print(table)
    print(f"\ntable: {out / 'comparison.md'}\nplot: {out / 'comparison.png'}\nruns: {out}")
    return 0


def frozen_cells(scores: FrozenScores, shots: list[int]) -> list[str]:
    """A frozen encoder's few-shot, k-NN and linear-probe accuracies, as the table's cells."""
    accuracies = [*(scores.fewshot[n] for n in shots), scores.knn, scores.linear]
    return [f"{100 * accuracy:.1f}%" for accuracy in accuracies]


def render(
    results: dict, frozen: dict[str, FrozenScores], steps: dict, wall: dict, tests: dict, args: argparse.Namespace
) -> str:
    """The comparison as a markdown table: each arm's test accuracy, then its encoder's frozen scores."""
    scored = [f"{n}-shot" for n in args.shots] + ["k-NN", "linear probe"]
    header = "| arm | " + " | ".join([*(f"top-1 ({name})" for name in tests), *scored]) + " | steps | wall time |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for arm, label in ARMS.items():
        top1 = [f"{100 * results[arm][name]:.1f}%" for name in tests]
        cells = " | ".join([*top1, *frozen_cells(frozen[arm], args.shots)])
        lines.append(f"| {label} | {cells} | {steps[arm]} | {wall[arm] / 60:.1f} min |")
    deltas = [f"{100 * (results['finetune'][n] - results['scratch'][n]):+.1f} pts" for n in tests]
    lines.append("| difference | " + " | ".join([*deltas, *("" for _ in scored)]) + " | | |")
    pretrained = frozen["pretrained"]
    cells = ", ".join(f"{name} {cell}" for name, cell in zip(scored, frozen_cells(pretrained, args.shots)))
    pretraining = (
        f"pretraining {wall['pretrain'] / 60:.1f} min" if "pretrain" in wall else f"pretrained: {args.pretrained}"
    )
    lines += [
        "",
        f"Frozen pretrained encoder before fine-tuning: {cells} ({pretraining}).",
        f"Frozen encoders are scored on the first test set's {pretrained.test} images; k-NN and the linear probe "
        f"learn from all {pretrained.train} training labels (the probe of the pretrained encoder chose l2 "
        f"{pretrained.linear_l2:g} on held-out training features).",
    ]
    return "\n".join(lines)


def plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """Validation accuracy against step, one line per arm."""
    figure, axes = plt.subplots(figsize=(6, 4), dpi=120)
    for label, points in curves.items():
        axes.plot([s for s, _ in points], [100 * v for _, v in points], marker="o", label=label)
    axes.set_xlabel("training step")
    axes.set_ylabel("validation top-1 (%)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
