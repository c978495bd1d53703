"""Which lever moves MPP ahead of training from scratch? The levers the paper names (learning rate,
pretraining length, patch size, model size), each a study (experiments.study) of the from-scratch and MPP
arms at 1,000 labels over 3 seeds, every choice made on the validation split; then one table of them all.

    python -m experiments.levers                              # every lever, in runs/levers/<lever>
    python -m experiments.levers --results results/levers     # and the table, JSON and each study there
    python -m experiments.levers --levers default lr --plan   # what two levers would run

The lever a user should take is the one whose MPP arm is best on validation (the mean over seeds of
each final run's last validation accuracy): the test numbers of every lever are shown, but none of them
picks. The `default` lever is the default study's settings: with --reuse (default runs/study, if it
holds a study) it brings that study's finished runs over instead of running them again, and every other
lever brings the runs it shares with `default` (e.g. the from-scratch runs of longer pretraining).
The default lever always runs: the others are measured beside it. Runs resume: the same command
again goes on where it stopped. A lever whose every run a finished study already ran alike, and
chose and scored alike, takes that study's numbers instead of running (experiments.reuse.covers):
its own earlier results (--results/<lever>/study.json, e.g. when its runs folder is gone) or a study
named by --taken-from (default results/study, whose from-scratch and MPP arms are the default lever).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from experiments import study
from experiments.report import interval, pct, write_results
from experiments.reuse import covers
from experiments.stats import summarise

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("scratch", "mpp")
BUDGET = 1000


def levers(quick: bool) -> dict[str, tuple[str, list[str]]]:
    """{name: (what it changes, the study's arguments)}; --quick scales the pretraining lever with its steps."""
    # --quick: 18 steps, so that every run still validates every 2 steps and the from-scratch runs are shared.
    pretrain = 18 if quick else 2400
    encoder = "model.init_args.encoder."
    return {
        "default": ("the default study's settings", []),
        "lr": (
            "wider lr grids: fine-tuning 0.03 to 0.2, from scratch 1e-3 to 1e-2",
            ["--finetune-lrs", "0.03", "0.06", "0.1", "0.2", "--scratch-lrs", "0.001", "0.003", "0.01"],
        ),
        "pretrain": (f"longer pretraining ({pretrain:,} steps)", ["--pretrain-steps", str(pretrain)]),
        "patch7": ("patches of 7 × 7 pixels: 16 tokens, not 49", ["--set", encoder + "patch_size=7"]),
        "wide": (
            "a wider encoder: ViT-Ti's width (192, 3 heads, MLP 768) at the demo's depth",
            ["--set", encoder + "dim=192", "--set", encoder + "heads=3", "--set", encoder + "mlp_dim=768"],
        ),
    }


def study_arguments(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    arguments = ["--budgets", str(BUDGET), "--arms", *ARMS, "--no-ablation", "--out", str(out / name)]
    arguments += levers(args.quick)[name][1] + (["--quick"] if args.quick else [])
    if args.seeds:
        arguments += ["--seeds", str(args.seeds)]
    source = (out / "default") if name != "default" else (Path(args.reuse) if args.reuse else None)
    if source is not None and (source / "settings.json").is_file():
        arguments += ["--reuse", str(source)]
    if args.results:
        arguments += ["--results", str(Path(args.results) / name)]
    return arguments


def taken(name: str, arguments: list[str], args: argparse.Namespace) -> tuple[Path, dict[str, Any]] | None:
    """(where, the study) of a finished study that ran every run of the lever's study alike: the lever's
    own earlier results (--results/<lever>) or one of --taken-from; None if none did."""
    settings = study.settings_from(study.arguments().parse_args(arguments))
    folders = ([Path(args.results) / name] if args.results else []) + [Path(f) for f in args.taken_from]
    for folder in folders:
        path = folder / "study.json"
        if path.is_file() and covers(found := json.loads(path.read_text()), settings):
            return folder, found
    return None


def project_path(path: str) -> str:
    """`path` (from where the command ran) relative to the project's folder where it lies inside it."""
    absolute = Path(path).absolute()
    return str(absolute.relative_to(ROOT)) if absolute.is_relative_to(ROOT) else str(absolute)


def final_validation(arm: dict[str, Any]) -> dict[str, Any]:
    """An arm's last validation accuracy per final run, summarised over seeds."""
    return summarise([curve[-1][1] for curve in arm["val_curves"].values()]).as_dict()


def summarise_levers(studies: dict[str, dict[str, Any]], quick: bool) -> dict[str, Any]:
    """Per lever: each arm's validation and test top-1 and chosen lr, and MPP − scratch on test; the
    lever chosen by MPP's validation accuracy."""
    table: dict[str, Any] = {}
    for name, found in studies.items():
        numbers = found["budgets"][str(BUDGET)]
        table[name] = {
            "label": levers(quick)[name][0],
            "command": found["command"],
            "arms": {
                arm: {
                    "lr": numbers["arms"][arm]["lr"],
                    "validation": final_validation(numbers["arms"][arm]),
                    "test": numbers["arms"][arm]["test_accuracy"],
                }
                for arm in ARMS
            },
            "mpp - scratch": numbers["differences"]["mpp - scratch"],
            "test_set": found["test_set"],
        }
    chosen = max(table, key=lambda name: table[name]["arms"]["mpp"]["validation"]["mean"])
    return {"levers": table, "chosen_on_validation": chosen}


def render(summary: dict[str, Any], command: str) -> str:
    lines = [
        f"Made by `{command}`. {BUDGET:,} labels; mean ± std over seeds; MPP − scratch paired by seed, "
        "with its 95% interval.",
        "",
        "| lever | MPP validation | scratch validation | MPP test | scratch test | MPP − scratch (test) "
        "| lrs (MPP, scratch) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, lever in summary["levers"].items():
        mpp, scratch = lever["arms"]["mpp"], lever["arms"]["scratch"]
        lines.append(
            f"| {name}: {lever['label']} | {pct(mpp['validation'])} | {pct(scratch['validation'])} | "
            f"{pct(mpp['test'])} | {pct(scratch['test'])} | {interval(lever['mpp - scratch'])} | "
            f"{mpp['lr']:g}, {scratch['lr']:g} |"
        )
    problems = [p for lever in summary["levers"].values() for p in lever["test_set"]["problems"]]
    lines += [
        "",
        f"Chosen on validation (MPP's validation top-1): {summary['chosen_on_validation']}.",
        "Test set: " + ("; ".join(problems) if problems else "read only after each study's last choice."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = list(levers(False))
    parser.add_argument("--levers", nargs="+", choices=names, default=names, help="the levers (default: all)")
    parser.add_argument("--quick", action="store_true", help="a few steps and 2 seeds: checks the plumbing")
    parser.add_argument("--seeds", type=int, help="seeds per arm (default 3; --quick 2)")
    parser.add_argument("--out", default="runs/levers", help="folder of the lever studies (default runs/levers)")
    parser.add_argument(
        "--reuse", default="runs/study", help="a study whose finished runs the default lever brings over (runs/study)"
    )
    parser.add_argument(
        "--taken-from",
        nargs="*",
        default=["results/study"],
        help="finished studies (folders with a study.json) whose numbers a lever takes instead of running its"
        " study, where they ran every run of it alike (default results/study); --results/<lever> too",
    )
    parser.add_argument("--plan", action="store_true", help="say what each lever's study would run, and stop")
    parser.add_argument("--results", help="also write the table, the JSON and each lever's study to this folder")
    args = parser.parse_args(argv)
    command = "python -m experiments.levers " + " ".join(sys.argv[1:] if argv is None else argv)
    # The studies run in the project's folder; paths inside it are passed (and recorded) relative to it.
    args.out, args.reuse, args.results = (
        None if a is None else project_path(a) for a in (args.out, args.reuse, args.results)
    )
    args.taken_from = [project_path(a) for a in args.taken_from]
    os.chdir(ROOT)
    out = Path(args.out)
    order = ["default", *(name for name in args.levers if name != "default")]  # the others reuse its runs
    studies = {}
    for name in order:
        print(f"levers: {name}: {levers(args.quick)[name][0]}", flush=True)
        arguments = study_arguments(name, args, out)
        found = taken(name, arguments, args)
        if found is not None:  # e.g. an earlier invocation whose runs are gone, or the default study
            print(f"levers: {name}: taken from {found[0]}/study.json, which ran every run of its study alike")
            studies[name] = found[1]
            continue
        if study.main(arguments + (["--plan"] if args.plan else [])) != 0:
            return 1
        if not args.plan:
            studies[name] = json.loads((out / name / "study.json").read_text())
    if args.plan:
        return 0
    summary = summarise_levers(studies, args.quick)
    summary["command"] = command.strip()
    table = render(summary, command.strip())
    write_results([out] + ([Path(args.results)] if args.results else []), "levers", summary, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
