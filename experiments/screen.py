"""Which levers make MPP pay? A screen on the validation split, seed 0: MPP (pretrained for 2,400 steps
on the unlabelled pool, fine-tuned at 1,000 labels) and training from scratch at 1,000 labels, each
taking one lever at a time in order and keeping the value that is best on validation.

    python -m experiments.screen --plan                              # the levers, and what they may run
    python -m experiments.screen --results results/curve/screen      # run (or go on), then the table and JSON
    python -m experiments.screen --quick --out runs/screen-quick     # a few steps on the embedded sample

Every value a lever offers (its first is today's recipe) is a recipe of its own, with its own learning
rate chosen from a grid around the lr the recipe so far chose (a grid whose best is at its edge extends
past it, at most twice); the value whose best lr is best on validation is kept (ties keep the value
before). An `ordered` lever (the steps) tries each value only while the one before beat the one before
it. Every lever that applies to training from scratch (drop path, more steps) is offered to it too, and
it starts from the curve's plateau (experiments.curve), so the baseline is as strong as the pretrained
arm. The screen never reads the test set. Runs are named by their recipe, so a recipe met again (the
value kept from one lever is the first of the next) is not run again; runs resume as the curve's do
(experiments.runner), and with --results a fresh checkout goes on from the committed ledger (a
pretraining run restored from it without its weights is made again where a fit or a frozen evaluation
still needs them).

Once the screen has ended, the same command confirms what it kept on the test set, over seeds
(experiments.confirm_plan): MPP's recipe at larger pretraining budgets, from scratch's at its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from experiments.confirm_plan import ConfirmPlan
from experiments.curve import invocation
from experiments.curve_plan import LABELS
from experiments.jobs import last_checkpoint, read_results, run_folder
from experiments.ledger import NAME, go_on_from, write_ledger
from experiments.plan import Plan, steps_of
from experiments.report import write_results
from experiments.runner import run_study
from experiments.screen_page import render, summarise
from experiments.screen_plan import PRECISION, Confirm, Screen, ScreenPlan
from experiments.settings import Settings
from experiments.study import CONFIGS, QUICK, full_splits, make_full_shards, sample_splits


def screen_from(args: argparse.Namespace) -> Screen:
    quick = args.quick
    study = Settings(
        splits=sample_splits() if quick else full_splits(),
        configs=CONFIGS,
        seeds=(0,),
        pretrain_steps=8 if quick else 2400,
        finetune_steps=4 if quick else 500,
        finetune_lrs=(),
        scratch_lrs=(),
        ablation=(),
        ablation_seeds=0,
        overrides=(*(QUICK if quick else ()), *PRECISION),
        checkpoint_every=2 if quick else 100,
        selected_arms=("scratch", "mpp"),
    )
    # the curve's choices at 2,400 pretraining steps (0.12) and at the from-scratch plateau (1e-3)
    points, extensions = (1, 0) if quick else (3, 2)
    confirm = Confirm((8,), (0, 1), 0, ()) if quick else Confirm()
    return Screen(study, study.pretrain_steps, quick, {"mpp": 0.12, "scratch": 1e-3}, points, 2.0, extensions, confirm)


def outline(screen: Screen) -> list[str]:
    """Each arm's levers, and the runs and steps of every value with its first grid (an ordered lever
    may stop sooner; each extension of a grid adds a run of its recipe)."""
    lines = [f"MPP pretrained {screen.pretrain_steps:,} steps; {LABELS:,} labels; seed 0; lr grids of {screen.points} "
             f"values x{screen.factor:g} apart, at most {screen.extensions} extensions"]  # fmt: skip
    plan = ScreenPlan(screen)
    for arm, levers in screen.levers.items():
        recipe = {lever.name: lever.values[0] for lever in levers}
        jobs = [plan.pretrain(recipe)] if arm == "mpp" else []
        jobs += [plan.fit(arm, recipe, 0.0)] * screen.points
        for lever in levers:
            lines.append(f"{arm}: {lever.name}: {' / '.join(lever.values)}" + (" (in order)" if lever.ordered else ""))
            for value in lever.values[1:]:
                changed = {**recipe, lever.name: value}
                jobs += ([plan.pretrain(changed)] if lever.part == "pretrain" else []) + [
                    plan.fit(arm, changed, 0.0)
                ] * screen.points
        for kind in ("pretrain", f"b{LABELS}"):
            steps = [steps_of(job) for job in jobs if job.name.startswith(kind + "/")]
            if steps:
                lines.append(
                    f"{arm}: {'pretraining' if kind == 'pretrain' else 'fits'}: {len(steps)} runs, {sum(steps):,} steps"
                )
    c = screen.confirm
    budgets = " and ".join(f"{budget:,}" for budget in c.budgets)
    lines.append(
        f"then the confirmation: MPP's kept recipe pretrained {budgets} steps with seeds {', '.join(map(str, c.seeds))} "
        f"({len(c.budgets) * len(c.seeds)} runs, {sum(c.budgets) * len(c.seeds):,} steps), its lr grid at each, "
        f"its final runs; from scratch's kept recipe with the same seeds; each final run tested once"
    )
    return lines


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps on the embedded sample: the plumbing")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each with cores/jobs threads")
    parser.add_argument("--out", help="folder of the runs and results (default runs/screen)")
    parser.add_argument("--plan", action="store_true", help="say what the screen would run, and stop")
    parser.add_argument("--report", action="store_true", help="write the table of what has finished, and stop")
    parser.add_argument(
        "--results", help="also copy the table, JSON and ledger to this folder (e.g. results/curve/screen)"
    )
    return parser


def remake_lost(plan: ConfirmPlan, out: Path) -> list[str]:
    """The finished runs that a fit or frozen evaluation still to run starts from, but whose weights are
    not under `out` (restored from a ledger on another machine): each one's result set aside
    (result.restored.json), so that it runs again with the same recipe and seed. Returns their names. (A
    test remakes its fit itself, keeping the numbers its point chose on: experiments.jobs.remake_first.)"""
    results = read_results(out)
    wanted, _, _ = plan.wanted(results)
    lost = sorted({name for job in wanted if job.name not in results and job.kind != "test"
                   for name in Plan.needs(job) if name in results and not last_checkpoint(out, name).exists()})  # fmt: skip
    for name in lost:
        folder = run_folder(out, name)
        (folder / "result.json").replace(folder / "result.restored.json")
    return lost


def goes_on(saved: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a screen saved with the settings `saved` goes on with `mine`: the same, or saved before its
    confirmation was part of it."""
    return {"confirm": mine["confirm"], **saved} == mine


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    out, results, command = invocation("screen", args, argv)
    screen, saved = screen_from(args), out / "settings.json"
    if args.plan:
        print("\n".join(outline(screen)))
        return 0
    mine = json.loads(json.dumps(screen.as_dict()))
    if results and (results / NAME).exists():
        go_on_from(results / NAME, out, lambda saved: goes_on(saved, mine), "screen")
    if saved.exists() and not goes_on(json.loads(saved.read_text()), mine):
        raise SystemExit(f"screen: {out} holds a screen with other settings; choose another --out")
    if args.report and not saved.exists():
        raise SystemExit(f"screen: {out} holds no screen (no settings.json); run it first")
    plan = ConfirmPlan(screen)
    if not args.report:
        if not args.quick:
            make_full_shards()
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(mine, indent=1))
        for name in remake_lost(plan, out):
            print(f"screen: {name} is made again: a run still to make starts from it and its weights are not here")
        start = time.time()
        try:
            run_study(screen.study, out, jobs=args.jobs, plan=plan)
        finally:
            print(f"screen: {time.time() - start:.0f} s this invocation")
    record = summarise(mine, plan, out, command.strip())
    table = render(record)
    write_results([out] + ([results] if results else []), "screen", record, table)
    if results:
        write_ledger(out, mine, results)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
