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
(experiments.runner), and with --results a fresh checkout goes on from the committed ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments.curve import without_time
from experiments.curve_plan import LABELS, val_every
from experiments.ledger import NAME, go_on_from, write_ledger
from experiments.plan import Job, Plan, lr_name, seeded, steps_of
from experiments.report import machine_counts, write_results
from experiments.runner import run_study
from experiments.settings import Settings
from experiments.study import CONFIGS, QUICK, ROOT, full_splits, make_full_shards, sample_splits

M = "--model.init_args."
# Every run in float32, whichever CPU it lands on (bf16-mixed where the CPU has bf16 otherwise): a value's
# lead must not be a machine's, and a screen may go on over sessions on different machines.
PRECISION = ("--trainer.precision", "32-true")


@dataclass(frozen=True)
class Lever:
    """A choice a recipe makes: its values (the first is today's), where it applies (`pretrain`: MPP's
    pretraining run; `fit`: the fine-tuning or from-scratch run) and its overrides for a value."""

    name: str
    values: tuple[str, ...]
    part: str
    flags: Callable[[str], tuple[str, ...]] = lambda value: ()
    ordered: bool = False  # the next value is tried only while each beat the one before
    lr: dict[str, float] = field(default_factory=dict)  # a value's own lr centre (another optimiser)


def optimiser(value: str) -> tuple[str, ...]:
    """SGD as the paper fine-tunes, or AdamW with weight decay 0.05 as MAE fine-tunes."""
    return (M + "optimizer.name", value) + ((M + "optimizer.weight_decay", "0.05") if value == "adamw" else ())


def target(value: str) -> tuple[str, ...]:
    """The 3-bit mean colour of a patch, or the paper's 4 x 4 downsized patch in 3-bit colours."""
    return (M + "target.kind", value) + ((M + "target.cells", "4") if value == "downsized_colour" else ())


def all_levers(quick: bool) -> dict[str, tuple[Lever, ...]]:
    """{arm: its levers in the order the screen takes them}."""
    drop_path = Lever("drop_path", ("0", "0.1"), "fit", lambda v: (M + "encoder.drop_path", v))
    mpp = (
        Lever("ratio", ("0.5", "0.75"), "pretrain", lambda v: (M + "corruption.ratio", v)),
        Lever("layout", ("scattered", "blocks"), "pretrain", lambda v: (M + "corruption.layout", v)),
        Lever("target", ("mean_colour", "downsized_colour"), "pretrain", target),
        Lever("layer_decay", ("1", "0.85", "0.75", "0.65"), "fit", lambda v: (M + "optimizer.layer_decay", v)),
        Lever("optimizer", ("sgd", "adamw"), "fit", optimiser, lr={"adamw": 1e-3}),
        drop_path,
        Lever("steps", ("4", "8") if quick else ("500", "1100", "2900", "10100"), "fit", ordered=True),
    )
    scratch = (drop_path, Lever("steps", ("8", "16") if quick else ("10100", "20100"), "fit", ordered=True))
    if quick:  # one lever of each part, and the steps
        return {"mpp": (mpp[0], mpp[3], mpp[-1]), "scratch": scratch}
    return {"mpp": mpp, "scratch": scratch}


@dataclass(frozen=True)
class Screen:
    """What a screen runs: the study's splits, configs and overrides (seed: its first), MPP's pretraining
    steps, each arm's first lr, and the lr grid: `points` values a factor `factor` apart, `extensions`."""

    study: Settings
    pretrain_steps: int
    quick: bool
    lrs: dict[str, float]
    points: int = 3
    factor: float = 2.0
    extensions: int = 2

    @property
    def levers(self) -> dict[str, tuple[Lever, ...]]:
        return all_levers(self.quick)

    def as_dict(self) -> dict[str, Any]:
        levers = {arm: [{"name": lever.name, "values": list(lever.values)} for lever in found]
                  for arm, found in self.levers.items()}  # fmt: skip
        return {**asdict(self), "study": self.study.as_dict(), "levers": levers}


def rounded(value: float) -> float:
    return float(f"{value:.3g}")


class ScreenPlan:
    """The jobs of a screen given what has finished, and its choices: the planner of experiments.runner."""

    def __init__(self, screen: Screen) -> None:
        self.c, self.s = screen, screen.study

    @staticmethod
    def key(recipe: dict[str, str], levers: tuple[Lever, ...], part: str) -> str:
        """A recipe's name for one part: its values other than today's, or `paper`."""
        changed = [f"{lever.name}={recipe[lever.name]}" for lever in levers
                   if lever.part == part and recipe[lever.name] != lever.values[0]]  # fmt: skip
        return ",".join(changed) or "paper"

    def pretrain(self, recipe: dict[str, str]) -> Job:
        levers, seed = self.c.levers["mpp"], self.s.seeds[0]
        flags = [flag for lever in levers if lever.part == "pretrain" for flag in lever.flags(recipe[lever.name])]
        overrides = ("--data.train", self.s.splits.pool, *self._seeded(seed, self.c.pretrain_steps), *flags)
        name = f"pretrain/p{self.c.pretrain_steps}/{self.key(recipe, levers, 'pretrain')}/seed{seed}"
        return Job(name, "fit", self.s.configs["pretrain"], overrides)

    def _seeded(self, seed: int, steps: int) -> tuple[str, ...]:
        return seeded(self.s, seed, steps, val_every(steps))

    def fit(self, arm: str, recipe: dict[str, str], lr: float) -> Job:
        """A fine-tuning (mpp) or from-scratch run of `recipe` with `lr`, seed 0."""
        levers, seed = self.c.levers[arm], self.s.seeds[0]
        flags = [flag for lever in levers if lever.part == "fit" for flag in lever.flags(recipe[lever.name])]
        overrides = [
            "--data.train", self.s.splits.labels[LABELS], *self._seeded(seed, int(recipe["steps"])),
            M + "optimizer.lr", f"{lr:g}", *flags,
        ]  # fmt: skip
        name = f"b{LABELS}/{arm}/{self.key(recipe, levers, 'fit')}/{lr_name(lr)}/seed{seed}"
        if arm == "mpp":
            pretrain = self.pretrain(recipe).name
            name = f"b{LABELS}/mpp/{pretrain.split('/')[2]}/{name.split('/', 2)[2]}"
            overrides += [M + "pretrained", f"{{run:{pretrain}}}"]
        return Job(name, "fit", self.s.configs["finetune" if arm == "mpp" else "scratch"], tuple(overrides))

    def candidate(
        self, arm: str, recipe: dict[str, str], centre: float, results: dict[str, dict], wanted: list[Job]
    ) -> dict[str, Any] | None:
        """A recipe's lr choice (the best validation top-1 of its grid; ties to the smaller lr), adding the
        jobs it needs to `wanted`; None until its grid has finished."""
        half = (self.c.points - 1) / 2
        lrs = [rounded(centre * self.c.factor ** (i - half)) for i in range(self.c.points)]
        if arm == "mpp":
            wanted.append(self.pretrain(recipe))
        for extended in range(self.c.extensions + 1):
            jobs = [self.fit(arm, recipe, lr) for lr in lrs]
            wanted += jobs
            if any(job.name not in results for job in jobs):
                return None
            val = [results[job.name]["val_accuracy"] or 0.0 for job in jobs]
            best = max(range(len(lrs)), key=lambda i: (val[i], -i))
            edge = len(lrs) > 1 and best in (0, len(lrs) - 1)
            if not edge or extended == self.c.extensions:
                grid = {lr_name(lr): v for lr, v in zip(lrs, val)}
                return {"lr": lrs[best], "val_accuracy": val[best], "grid": grid, "edge": edge}
            lrs = [*lrs, rounded(lrs[-1] * self.c.factor)] if best else [rounded(lrs[0] / self.c.factor), *lrs]
        raise AssertionError("unreachable")

    def walk(self, arm: str, results: dict[str, dict], wanted: list[Job]) -> tuple[list[dict[str, Any]], bool]:
        """(a row per value tried so far, whether the arm's screen has ended), adding its jobs to `wanted`:
        the levers in order, each value a candidate, each lever's winner the recipe of the next."""
        levers = self.c.levers[arm]
        recipe = {lever.name: lever.values[0] for lever in levers}
        current = self.candidate(arm, recipe, self.c.lrs[arm], results, wanted)
        rows: list[dict[str, Any]] = []
        for lever in levers:
            if current is None:  # a pretraining lever's runs need no choice: they may run meanwhile
                wanted += [
                    self.pretrain({**recipe, lever.name: v}) for v in lever.values[1:] if lever.part == "pretrain"
                ]
                return rows, False
            values = lever.values
            tried: dict[str, dict[str, Any] | None] = {values[0]: current}
            for i, value in enumerate(values[1:], start=1):
                if lever.ordered and i >= 2 and not beats(tried[values[i - 1]], tried[values[i - 2]]):
                    break
                centre = lever.lr.get(value, current["lr"])
                tried[value] = self.candidate(arm, {**recipe, lever.name: value}, centre, results, wanted)
                if lever.ordered and tried[value] is None:
                    break  # whether to go on waits for it
            found = {value: choice for value, choice in tried.items() if choice is not None}
            if len(found) < len(tried):
                return rows + [{"arm": arm, "lever": lever.name, "value": v, **c, "chosen": False}
                               for v, c in found.items()], False  # fmt: skip
            chosen = max(found, key=lambda v: (found[v]["val_accuracy"], -values.index(v)))
            rows += [{"arm": arm, "lever": lever.name, "value": value, **choice, "chosen": value == chosen}
                     for value, choice in found.items()]  # fmt: skip
            recipe, current = {**recipe, lever.name: chosen}, found[chosen]
        return rows, current is not None

    def screen(self, results: dict[str, dict]) -> tuple[list[Job], list[dict[str, Any]], bool]:
        """(every job wanted so far, MPP's first, each row tried so far, whether the screen has ended)."""
        wanted: list[Job] = []
        rows: list[dict[str, Any]] = []
        ended = True
        for arm in self.c.levers:
            found, done = self.walk(arm, results, wanted)
            rows, ended = rows + found, ended and done
        return list({job.name: job for job in wanted}.values()), rows, ended

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]:
        """{arm/lever: the value kept and its lr} for each lever whose values have all been tried."""
        _, rows, _ = self.screen(results)
        chosen = {f"{row['arm']}/{row['lever']}": row for row in rows if row["chosen"]}
        return {
            key: {"value": row["value"], "lr": row["lr"], "val_accuracy": row["grid"]} for key, row in chosen.items()
        }

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]:
        wanted, _, ended = self.screen(results)
        todo = [job for job in wanted if job.name not in results]
        return [job for job in todo if all(name in results for name in Plan.needs(job))], ended and not todo

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]:
        return []


def beats(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and a["val_accuracy"] > b["val_accuracy"]


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
    return Screen(study, study.pretrain_steps, quick, {"mpp": 0.12, "scratch": 1e-3}, points, 2.0, extensions)


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
    return lines


def summarise(screen: Screen, plan: ScreenPlan, out: Path, command: str) -> dict[str, Any]:
    from experiments.runner import read_results, test_reads
    from experiments.timing import elapsed

    results = read_results(out)
    _, rows, ended = plan.screen(results)
    recipes = {arm: {row["lever"]: row["value"] for row in rows if row["arm"] == arm and row["chosen"]}
               for arm in screen.levers}  # fmt: skip
    attempts = json.loads((out / "attempts.json").read_text()) if (out / "attempts.json").exists() else []
    return {
        "command": command, "settings": screen.as_dict(), "rows": rows, "kept": recipes, "ended": ended,
        "machines": machine_counts(results), "test_reads": len(test_reads(out)),
        "wall_hours": elapsed(attempts) / 3600, "invocations": len(attempts),
        "run_hours": sum(result["wall_seconds"] for result in results.values()) / 3600,
    }  # fmt: skip


def render(record: dict[str, Any]) -> str:
    settings = record["settings"]
    lines = [
        f"Made by `{record['command']}`. Seed 0; validation top-1 at the last step on the held-out split "
        f"({settings['study']['splits']['val']}); MPP pretrained {settings['pretrain_steps']:,} steps, "
        f"every run at {LABELS:,} labels. Each value's lr is the best of its own grid.",
        "",
        "Runs computed on: "
        + "; ".join(f"{k}: {n} runs" for k, n in record["machines"].items())
        + f" (the precision the CPU would take; every run here is {PRECISION[1]}).",
        "",
        "| arm | lever | value | lr (validation top-1 per lr) | validation top-1 | kept |",
        "|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        grid = ", ".join(f"{lr[2:]}: {100 * v:.1f}" for lr, v in row["grid"].items())
        edge = "; best at the edge" if row["edge"] else ""
        lines.append(f"| {row['arm']} | {row['lever']} | {row['value']} | {row['lr']:g} ({grid}{edge}) | "
                     f"{100 * row['val_accuracy']:.1f} | {'yes' if row['chosen'] else ''} |")  # fmt: skip
    kept = {
        arm: ", ".join(f"{k}={v}" for k, v in values.items()) or "none yet" for arm, values in record["kept"].items()
    }
    lines += [
        "",
        "Kept so far: " + "; ".join(f"{arm}: {values}" for arm, values in kept.items()) + ".",
        "The screen has " + ("ended." if record["ended"] else "not ended: the same command goes on."),
        f"Test set: read {record['test_reads']} times (the screen reads the validation split only).",
        f"Wall time: {record['wall_hours']:.1f} h over {record['invocations']} invocation(s); "
        f"run time {record['run_hours']:.1f} h.",
    ]
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    out = Path(args.out or "runs/screen").absolute()
    results = Path(args.results).absolute() if args.results else None
    os.chdir(ROOT)
    given = sys.argv[1:] if argv is None else argv
    command = "python -m experiments.screen " + " ".join(shlex.quote(a) for a in without_time(given))
    screen, saved = screen_from(args), out / "settings.json"
    if args.plan:
        print("\n".join(outline(screen)))
        return 0
    mine = json.loads(json.dumps(screen.as_dict()))
    if results and (results / NAME).exists():
        go_on_from(results / NAME, out, lambda saved: saved == mine, "screen")
    if saved.exists() and json.loads(saved.read_text()) != mine:
        raise SystemExit(f"screen: {out} holds a screen with other settings; choose another --out")
    if args.report and not saved.exists():
        raise SystemExit(f"screen: {out} holds no screen (no settings.json); run it first")
    plan = ScreenPlan(screen)
    if not args.report:
        if not args.quick:
            make_full_shards()
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(mine, indent=1))
        start = time.time()
        try:
            run_study(screen.study, out, jobs=args.jobs, plan=plan)
        finally:
            print(f"screen: {time.time() - start:.0f} s this invocation")
    record = summarise(screen, plan, out, command.strip())
    table = render(record)
    write_results([out] + ([results] if results else []), "screen", record, table)
    if results:
        write_ledger(out, mine, results)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
