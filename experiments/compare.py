"""Does masked patch prediction help? Pretrain, then fine-tune the pretrained encoder next to
the same classifier trained from scratch — same labels, augmentation, steps and evaluation —
and write a markdown table and a plot of validation accuracy against step. The table scores every
encoder frozen too (the pretrained one and both arms'): few-shot, k-NN and linear probe.

    python -m experiments.compare   # the demo configs, embedded sample
    python -m experiments.compare --pretrained runs/demo/pretrain/checkpoints/last.ckpt \\
        --train shards/fashion-mnist/train-000000.tar --out runs/compare-1k   # 1,000 labels
    python -m experiments.compare --test shards/fashion-mnist/test-000000.tar 'full=shards/fmnist-full/test-000000.tar'

The runs are jobs of experiments.runner, as a study's are, but each as its config sets it up (its W&B
run, pictures and checkpoints) in a folder of its own directly under --out: pretrain/, finetune/,
scratch/, each arm's test-<name>/ within its own, and frozen/pretrained/. Run again, the comparison
keeps the runs that finished and resumes the others from their last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.jobs import FLAT, run_folder  # noqa: E402
from experiments.plan import Job  # noqa: E402
from experiments.runner import InOrder, run_study  # noqa: E402
from experiments.settings import Settings  # noqa: E402
from mpp.config import read_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"finetune": "MPP pretrained, fine-tuned", "scratch": "from scratch"}


def parse_tests(specs: list[str]) -> dict[str, str]:
    """["name=spec" or "spec", ...] -> {name: shard spec}."""
    tests = {}
    for index, spec in enumerate(specs):
        name, sep, shards = spec.partition("=")
        named = sep and not any(c in name for c in "/:{")
        tests[name if named else f"test{index}"] = shards if named else spec
    return tests


def arguments(argv: list[str] | None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


def steps(config: str, given: int | None) -> tuple[str, str]:
    """A fit's length, as given or as its config has it (a study's job always names it)."""
    return "--trainer.max_steps", str(given or read_config(ROOT / config)["trainer"]["max_steps"])


def comparison(args: argparse.Namespace) -> tuple[Settings, list[Job]]:
    """What the runner needs: the settings its jobs read (the test set, the frozen evaluations'), and the
    jobs in order: pretraining and its frozen encoder, then each arm's fit and its tests, the first of
    which scores the arm's encoder frozen."""
    tests = parse_tests(args.test)
    first_test = next(iter(tests.values()))
    labelled = args.train or read_config(ROOT / args.finetune)["data"]["train"]  # the arms' labelled shards
    frozen = (labelled, first_test)
    jobs = []
    if args.pretrained is None:
        jobs.append(
            Job("pretrain", "fit", args.pretrain, steps(args.pretrain, args.pretrain_steps), as_configured=True)
        )
    source = args.pretrained or "pretrain"
    jobs.append(
        Job("frozen/pretrained", "frozen", checkpoint=source, frozen=frozen, reads_test=True, as_configured=True)
    )
    for arm in ARMS:
        config = getattr(args, arm)
        overrides = [*(["--data.train", args.train] if args.train else []), *steps(config, args.steps)]
        overrides += ["--model.init_args.pretrained", args.pretrained or "{run:pretrain}"] if arm == "finetune" else []
        jobs.append(Job(arm, "fit", config, tuple(overrides), as_configured=True))
        for index, (name, spec) in enumerate(tests.items()):
            scored = frozen if index == 0 else None
            jobs.append(Job(f"{arm}/test-{name}", "test", config, tuple(overrides), checkpoint=arm, frozen=scored,
                            reads_test=True, as_configured=True, test=spec))  # fmt: skip
    configs = {"pretrain": args.pretrain, "finetune": args.finetune, "scratch": args.scratch}
    settings = Settings.of_runs(configs, test=first_test, shots=tuple(args.shots), frozen_max_train=args.frozen_train)
    return settings, jobs


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    given = {key: value for key, value in vars(args).items() if key != "out"}
    if (out / FLAT).exists() and json.loads((out / FLAT).read_text()) != given:
        earlier = json.loads((out / FLAT).read_text())
        changed = ", ".join(f"--{key.replace('_', '-')} {earlier.get(key)} -> {value}"
                            for key, value in given.items() if earlier.get(key) != value)  # fmt: skip
        print(f"compare: error: {out} holds a comparison of other arguments ({changed}); give another --out, "
              "or delete it to start over", file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / FLAT).write_text(json.dumps(given, indent=1))  # the runs' folders directly under out
    os.environ.setdefault("WANDB_SILENT", "true")
    settings, jobs = comparison(args)
    say = lambda line: print(line.replace("study: ", "compare: "), flush=True)  # noqa: E731
    results = run_study(settings, out, jobs=1, plan=InOrder(jobs), say=say)

    tests = parse_tests(args.test)
    wall = {name: results[name]["wall_seconds"] for name in ("pretrain", *ARMS) if name in results}
    frozen = {"pretrained": results["frozen/pretrained"]["frozen"]}
    frozen |= {arm: results[f"{arm}/test-{next(iter(tests))}"]["frozen"] for arm in ARMS}
    accuracy = {arm: {name: results[f"{arm}/test-{name}"]["test_accuracy"] for name in tests} for arm in ARMS}
    saved = {arm: torch.load(run_folder(out, arm) / "checkpoints" / "last.ckpt", weights_only=True) for arm in ARMS}
    steps_taken = {arm: checkpoint["global_step"] for arm, checkpoint in saved.items()}
    pretrained = Path(args.pretrained) if args.pretrained else run_folder(out, "pretrain") / "checkpoints" / "last.ckpt"
    saved["pretrain"] = torch.load(pretrained, weights_only=True)
    table = render(accuracy, frozen, steps_taken, wall, tests, args)
    table += "\n" + recipe({arm: checkpoint["hyper_parameters"] for arm, checkpoint in saved.items()})
    (out / "comparison.md").write_text(table + "\n")
    numbers = {
        "test_accuracy": accuracy,
        **{
            key: {name: scores[key] for name, scores in frozen.items()}
            for key in ("fewshot", "knn", "linear", "linear_l2")
        },
        "steps": steps_taken,
        "wall_seconds": wall,
    }
    (out / "comparison.json").write_text(json.dumps(numbers, indent=2))
    plot({ARMS[arm]: [tuple(point) for point in results[arm]["val_curve"]] for arm in ARMS}, out / "comparison.png")
    print(table)
    print(f"\ntable: {out / 'comparison.md'}\nplot: {out / 'comparison.png'}\nruns: {out}")
    return 0


def frozen_cells(scores: dict[str, Any], shots: list[int]) -> list[str]:
    """A frozen encoder's few-shot, k-NN and linear-probe accuracies (a job's result["frozen"]), as the
    table's cells."""
    accuracies = [*(scores["fewshot"][str(n)] for n in shots), scores["knn"], scores["linear"]]
    return [f"{100 * accuracy:.1f}%" for accuracy in accuracies]


def render(
    results: dict, frozen: dict[str, dict[str, Any]], steps: dict, wall: dict, tests: dict, args: argparse.Namespace
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
        f"Frozen encoders are scored on the first test set's {pretrained['test']} images; k-NN and the linear probe "
        f"learn from all {pretrained['train']} training labels (the probe of the pretrained encoder chose l2 "
        f"{pretrained['linear_l2']:g} on held-out training features).",
    ]
    return "\n".join(lines)


def recipe(hparams: dict[str, dict[str, Any]]) -> str:
    """Which recipe each run took, from its checkpoint's hyperparameters (every default filled in): the
    corruption and target of the pretraining, the optimiser, layer decay and drop path of both arms."""
    arms = []
    if "corruption" in hparams["pretrain"]:  # an MPP pretraining (--pretrained may name another checkpoint)
        corruption, target = hparams["pretrain"]["corruption"], hparams["pretrain"]["target"]
        predicts = {"mean_colour": f"the {target['bits']}-bit mean colour",
                    "downsized_colour": f"the {target['cells']} x {target['cells']} downsized {target['bits']}-bit colours"}  # fmt: skip
        arms.append(f"pretraining corrupts {corruption['ratio']:.0%} of the patches ({corruption['layout']}) and "
                    f"predicts {predicts.get(target['kind'], target['kind'])}")  # fmt: skip
    for arm, label in (("finetune", "fine-tuning"), ("scratch", "from scratch")):
        optimiser, encoder = hparams[arm]["optimizer"], hparams[arm]["encoder"]
        decay = f", layer decay {optimiser['layer_decay']:g}" if arm == "finetune" else ""
        arms.append(f"{label} {optimiser['name']}{decay}, drop path {encoder['drop_path']:g}")
    return "Recipe: " + "; ".join(arms) + "."


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
