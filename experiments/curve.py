"""Where does MPP pay? The pretraining-budget curve: MPP pretrained on the unlabelled pool for several
budgets of optimiser steps (each its own run with its own warmup and cosine decay), each fine-tuned at
1,000 labels; beside it training from scratch over a grid of step counts, whose best on validation is
its plateau and whose runs of pretraining + fine-tuning steps are the matched-compute arm of each
budget; supervised pretraining on the labelled images at the same budgets; and the hybrid (the same ViT
on a small ResNet stem) from scratch over the same grid of step counts, to its own plateau.

    python -m experiments.curve --plan                     # what it runs, and how many steps
    python -m experiments.curve --results results/curve    # run (or go on), then the table, JSON and picture
    python -m experiments.curve --quick --out runs/curve-quick   # a few steps on the embedded sample

Every learning rate is chosen on the validation split with the first seed, from a grid that extends
past its edge while its best value is there (at most 6 times); the from-scratch step count
(the plateau) is the one whose final runs are best on validation, the mean over seeds. The test set is
read once per final run, after its point's choice, and once per frozen pretrained encoder. A slot
that would wait for a grid's runs runs ahead the lr its next extension would take (`spares`).
Runs resume: the same command again goes on where it stopped, and --budgets may add budgets later
(the runs already made are kept). With --results, the finished runs' numbers go there too (ledger.json,
experiments.ledger), and the same command on a fresh checkout restores them and goes on; a run stopped
half way resumes only where its checkpoints are, so `--within HOURS` starts only the runs that the
finished ones' speed says will end in that time, longest first (experiments.timing). It needs the
full FashionMNIST shards (`apt-get install dataset-fashion-mnist`; made once, as
`python -m experiments.study --full` makes them). Where the results folder holds the screen's record
(screen/screen.json, experiments.screen) with a confirmed point, the table and picture add its recipe
beside the paper's: MPP fine-tuned, its frozen encoders, and from scratch with its own kept recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.curve_plan import BUDGETS, FINETUNE_LRS, SCRATCH_LRS, Curve, CurvePlan, outline
from experiments.ledger import NAME, go_on_from, write_ledger
from experiments.runner import run_study
from experiments.settings import Settings
from experiments.study import CONFIGS, QUICK, ROOT, full_splits, make_full_shards, sample_splits

SCREEN = Path("screen/screen.json")  # under the curve's results: the screen's record, whose confirmation it draws


def curve_from(args: argparse.Namespace) -> Curve:
    quick = args.quick
    splits = sample_splits() if quick else full_splits()
    budgets = tuple(sorted(args.budgets or ((4, 8) if quick else BUDGETS)))
    study = Settings(
        splits=splits,
        configs=CONFIGS,
        seeds=tuple(range(args.seeds or (2 if quick else 3))),
        pretrain_steps=max(budgets),
        finetune_steps=4 if quick else 500,
        finetune_lrs=(0.01, 0.03) if quick else FINETUNE_LRS,
        scratch_lrs=(1e-3, 3e-3) if quick else SCRATCH_LRS,
        ablation=(),
        ablation_seeds=0,
        overrides=QUICK if quick else (),
        checkpoint_every=2 if quick else 100,
        frozen_max_train=1000 if quick else 10000,
        selected_arms=("scratch", "matched", "mpp", "supervised"),
    )
    return Curve(
        study,
        budgets,
        supervised=args.supervised,
        hybrid=args.hybrid,
        extensions=1 if quick else 6,
        more_seeds=1 if quick else 2,
    )


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps on the embedded sample: the plumbing")
    parser.add_argument(
        "--budgets", type=int, nargs="+", help=f"pretraining steps (default {' '.join(map(str, BUDGETS))})"
    )
    parser.add_argument("--seeds", type=int, help="seeds per point (default 3; --quick 2)")
    parser.add_argument("--supervised", action=argparse.BooleanOptionalAction, default=True,
                        help="supervised pretraining at each budget (default: on)")  # fmt: skip
    parser.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                        help="the hybrid from scratch to its plateau (default: on)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each with cores/jobs threads")
    parser.add_argument("--within", type=float, metavar="HOURS",
                        help="start only the runs expected to finish within HOURS (from the finished runs' "
                        "speed), longest first, then stop: no run is left half done")  # fmt: skip
    parser.add_argument("--out", help="folder of the runs and results (default runs/curve)")
    parser.add_argument("--plan", action="store_true", help="say what the curve would run, and stop")
    parser.add_argument(
        "--report", action="store_true", help="write the table and picture of what has finished, and stop"
    )
    parser.add_argument("--results", help="also copy the table, JSON and picture to this folder (e.g. results/curve)")
    return parser


def extends(saved: dict[str, Any], curve: Curve) -> bool:
    """Whether a curve saved with `saved` goes on as `curve`: the same, or with budgets added, grids
    allowed more extensions or the hybrid added."""
    saved = {"more_seeds": 2, "hybrid": False, **saved}  # settings a curve saved before they existed had these

    def rest(values: dict[str, Any]) -> dict[str, Any]:
        return {**values, "budgets": None, "extensions": None, "hybrid": None,
                "study": {**values["study"], "pretrain_steps": None}}  # fmt: skip

    mine = json.loads(json.dumps(curve.as_dict()))
    grows = set(saved["budgets"]) <= set(mine["budgets"]) and saved["extensions"] <= mine["extensions"]
    grows = grows and saved["hybrid"] <= mine["hybrid"]
    return rest(saved) == rest(mine) and grows


def without_time(args: Sequence[str]) -> list[str]:
    """A curve's arguments less those that change when it runs, not what it finds (--report, --within)."""
    kept, skip = [], False
    for arg in args:
        if not skip and arg != "--report" and not arg.startswith("--within"):
            kept.append(arg)
        skip = arg == "--within"
    return kept


def invocation(name: str, args: argparse.Namespace, argv: list[str] | None) -> tuple[Path, Path | None, str]:
    """(its run folder, its results folder or None, the command as the record names it) of a curve or a
    screen given `args` (--out, --results) and its arguments, in the project's folder from now on."""
    out = Path(args.out or f"runs/{name}").absolute()
    results = Path(args.results).absolute() if args.results else None
    os.chdir(ROOT)
    given = sys.argv[1:] if argv is None else argv
    return out, results, f"python -m experiments.{name} " + " ".join(shlex.quote(a) for a in without_time(given))


def main(argv: list[str] | None = None) -> int:
    from experiments.curve_report import report  # matplotlib only where a report is made

    args = arguments().parse_args(argv)
    out, results, command = invocation("curve", args, argv)
    curve = curve_from(args)
    if args.plan:
        print("\n".join(outline(curve)))
        return 0
    saved_path = out / "settings.json"
    if results and (results / NAME).exists():
        go_on_from(results / NAME, out, lambda saved: extends(saved, curve), "curve")
    if args.report and not saved_path.exists():
        raise SystemExit(f"curve: {out} holds no curve (no settings.json); run it first")
    if saved_path.exists() and not extends(json.loads(saved_path.read_text()), curve):
        raise SystemExit(f"curve: {out} holds a curve with other settings; choose another --out")
    if not args.report:
        if not args.quick:
            make_full_shards()
        out.mkdir(parents=True, exist_ok=True)
        saved_path.write_text(json.dumps(curve.as_dict(), indent=1))
        start = time.time()
        until = start + 3600 * args.within if args.within else None
        try:
            run_study(curve.study, out, jobs=args.jobs, plan=CurvePlan(curve), until=until)
        finally:
            print(f"curve: {time.time() - start:.0f} s this invocation")
    folders = [out] + ([results] if results else [])
    table = report(curve, CurvePlan(curve), out, folders, command.strip(), results / SCREEN if results else None)
    if results:
        write_ledger(out, json.loads(saved_path.read_text()), results)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
