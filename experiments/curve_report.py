"""What the pretraining-budget curve measured (experiments.curve): its numbers as one JSON-able mapping,
of the points finished so far (`summarise_curve`), with the audit of its test-set reads and what its
intervals carry (`conclusions`); `report` writes them with the page (experiments.curve_page)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.curve_page import NAMES, PAIRS, plot, render  # noqa: E402
from experiments.curve_plan import SCRATCH_ARMS, Curve, CurvePlan, outline, pretrain_name  # noqa: E402
from experiments.finals import audit, numbers  # noqa: E402
from experiments.jobs import read_results, test_reads  # noqa: E402
from experiments.plan import Job, kind_of  # noqa: E402
from experiments.report import machine_counts, write_results  # noqa: E402
from experiments.stats import paired  # noqa: E402
from experiments.timing import elapsed  # noqa: E402


def _point(
    plan: CurvePlan, point: str, choice: dict[str, Any], results: dict[str, dict], seeds: tuple[int, ...]
) -> dict[str, Any] | None:
    """A chosen point's numbers over `seeds` (experiments.finals.numbers), or None until they are all in."""
    arm, size = point.split("/")
    sources = [] if arm in SCRATCH_ARMS else [pretrain_name(arm, int(size[1:]), seed) for seed in seeds]
    return numbers(choice, dict(zip(seeds, plan.finals(point, choice["lr"], seeds))), sources, results)


def summarise_curve(curve: Curve, plan: CurvePlan, out: Path) -> dict[str, Any]:
    results = read_results(out)
    path = out / "choices.json"
    choices = json.loads(path.read_text()) if path.exists() else {}
    widened = plan.widened(choices, results)
    points = {  # a widened point's first seeds until its added ones have their tests
        point: _point(plan, point, choices[point], results, plan.seeds(point, widened))
        or _point(plan, point, choices[point], results, curve.study.seeds)
        for point in curve.points()
        if choices.get(point)
    }
    plateau = choices.get("scratch/plateau")
    tune = curve.study.finetune_steps
    rows: dict[str, dict[str, Any]] = {}
    for budget in curve.budgets:
        arms = {"mpp": points.get(f"mpp/p{budget}"), "supervised": points.get(f"supervised/p{budget}"),
                "matched": points.get(f"scratch/s{budget + tune}"),
                "plateau": points.get(f"scratch/s{plateau['steps']}") if plateau else None}  # fmt: skip
        by_seed = {
            arm: {int(s): v for s, v in entry["test_accuracy_by_seed"].items()} for arm, entry in arms.items() if entry
        }
        rows[str(budget)] = {
            "arms": {arm: entry["test_accuracy"] for arm, entry in arms.items() if entry},
            "differences": {
                key: paired(by_seed[a], by_seed[b]).as_dict()
                for key, (a, b) in PAIRS.items()
                if a in by_seed and b in by_seed
            },  # fmt: skip
        }
    machines = machine_counts(results)
    wall: dict[str, float] = {}
    restored: dict[str, int] = {}
    for result in results.values():
        if "restored" in result:
            restored[result["restored"]] = restored.get(result["restored"], 0) + 1
        kind = kind_of(Job(result["name"], result["kind"]))
        if kind == "fine-tuning":
            kind = {"scratch": "from scratch", "hybrid": "hybrid from scratch"}.get(result["name"].split("/")[1], kind)
        wall[kind] = wall.get(kind, 0.0) + result["wall_seconds"]
    attempts = json.loads((out / "attempts.json").read_text()) if (out / "attempts.json").exists() else []
    return {
        "remade": remade_runs(results),
        "curve": curve.as_dict(),
        "plan": outline(curve),
        "points": points,
        "plateau": plateau,
        "hybrid_plateau": choices.get("hybrid/plateau"),
        "rows": rows,
        "conclusions": conclusions(curve, rows),
        "loss_predicts": loss_correlation(curve, points),
        "hybrid": hybrid_plateau(points, choices),
        "machines": machines,
        "widened": sorted(widened),
        "test_set": audit(plan, choices, test_reads(out), widened),
        "restored": restored,
        "ahead_unwanted": plan.unwanted(results),
        "wall_seconds": {
            "elapsed": elapsed(attempts),
            "attempts": sum(attempt.get("invocations", 1) for attempt in attempts),
            "jobs_by_kind": wall,
        },  # fmt: skip
    }


def remade_runs(results: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """The runs a test made again (restored without weights: experiments.runner.needs_remake): the validation
    their point chose on and the remake's, each with its CPU."""
    found = {}
    for name, result in results.items():
        if "remade" in result:
            run, again = results[name.removesuffix("/test")], result["remade"]
            cpus = [" / ".join(sorted({m["cpu"] for m in entry["machines"]})) for entry in (run, again)]
            found[run["name"]] = {"val_accuracy": [run["val_accuracy"], again["val_accuracy"]], "cpu": cpus}
    return found


def hybrid_plateau(points: dict[str, Any], choices: dict[str, Any]) -> dict[str, Any] | None:
    """The hybrid from scratch at its plateau against the ViT from scratch at its own: their test top-1
    and the paired difference over the seeds both have; None until both plateaus have their tests."""
    found: dict[str, tuple[int, dict[str, Any]]] = {}
    for arm in ("hybrid", "scratch"):
        plateau = choices.get(f"{arm}/plateau")
        entry = points.get(f"{arm}/s{plateau['steps']}") if plateau else None
        if not plateau or not entry:
            return None
        found[arm] = plateau["steps"], entry
    hybrid, scratch = ({int(k): v for k, v in found[arm][1]["test_accuracy_by_seed"].items()} for arm in found)
    steps, entry = found["hybrid"]
    return {
        "steps": steps,
        "test_accuracy": entry["test_accuracy"],
        "hybrid - plateau": paired(hybrid, scratch).as_dict(),
    }


# A budget's verdict on a difference, as the conclusions say it.
VERDICTS = {
    "ahead": "ahead with a 95% interval clear of zero at",
    "behind": "behind with a 95% interval clear of zero at",
    "holds zero": "an interval that holds zero at",
    "not measured yet": "not measured yet at",
}


def conclusions(curve: Curve, rows: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per comparison, what each budget's 95% interval says (ahead or behind clear of zero, or holding
    zero) and which budgets are not measured yet: "from N on" only where every budget from N on is
    measured and clear."""
    found = {}
    for key, (a, b) in PAIRS.items():
        verdicts: dict[str, list[int]] = {kind: [] for kind in VERDICTS}
        for budget in curve.budgets:
            difference = rows.get(str(budget), {}).get("differences", {}).get(key)
            if difference is None:
                verdicts["not measured yet"].append(budget)
            elif (difference["low"] or 0) > 0:
                verdicts["ahead"].append(budget)
            elif (difference["high"] or 0) < 0:
                verdicts["behind"].append(budget)
            else:
                verdicts["holds zero"].append(budget)
        name = f"{NAMES[a]} − {NAMES[b]}"
        if len(verdicts["not measured yet"]) == len(curve.budgets):
            found[key] = f"{name}: not measured yet"
            continue
        ahead = verdicts["ahead"]
        if ahead and ahead == [budget for budget in curve.budgets if budget >= ahead[0]]:
            verdicts["ahead"] = []
            parts = [f"ahead with a 95% interval clear of zero from {ahead[0]:,} pretraining steps on"]
        else:
            parts = []
        parts += [f"{VERDICTS[kind]} {steps_list(budgets)}" for kind, budgets in verdicts.items() if budgets]
        found[key] = f"{name}: " + "; ".join(parts)
    return found


def steps_list(budgets: list[int]) -> str:
    """[600, 2400] -> '600 and 2,400 pretraining steps'."""
    named = [f"{budget:,}" for budget in budgets]
    return (", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]) + " pretraining steps"


def pearson(xs: Any, ys: Any) -> float | None:
    """Pearson's r, or None where either side is constant (no correlation to speak of)."""
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return None


def loss_correlation(curve: Curve, points: dict[str, Any]) -> dict[str, Any] | None:
    """Pearson's r between an MPP pretraining run's final validation loss and the test top-1 of the run
    that fine-tunes it, over every (budget, seed) measured, and within each budget of 3 or more seeds
    (does the loss rank the seeds of one budget, or only the budgets?); None before two budgets are."""
    pairs: list[tuple[float, float]] = []
    within: dict[str, dict[str, Any]] = {}
    for budget in curve.budgets:
        entry = points.get(f"mpp/p{budget}")
        if entry and entry.get("pretrain_val_loss"):
            seeds = list(zip(entry["pretrain_val_loss"]["values"], entry["test_accuracy"]["values"]))
            pairs += seeds
            within[str(budget)] = {"n": len(seeds), "pearson_r": pearson(*zip(*seeds)) if len(seeds) >= 3 else None}
    if len(within) < 2:
        return None
    return {"n": len(pairs), "pearson_r": pearson(*zip(*pairs)), "within": within}


def confirmed_recipe(screen: Path) -> dict[str, Any] | None:
    """The confirmation of the screen whose record is `screen` (its screen.json, experiments.screen): its
    command, recipes, points and differences; None before the screen has confirmed a point."""
    if not screen.exists():
        return None
    record = json.loads(screen.read_text())
    found = record.get("confirmation")
    if not found or not found["points"]:
        return None
    return {"command": record["command"], **{key: found[key] for key in ("recipes", "points", "differences")}}


def report(
    curve: Curve, plan: CurvePlan, out: Path, folders: Sequence[Path], command: str, screen: Path | None = None
) -> str:
    """Summarise what has finished, with the confirmation of the screen whose record is `screen` where it has
    one, and write curve.json, curve.md and curve.png into each folder; returns the table."""
    record = summarise_curve(curve, plan, out)
    record["command"] = command
    record["recipe"] = confirmed_recipe(screen) if screen else None
    table = render(record, command)
    write_results(folders, "curve", record, table)
    for folder in folders:
        plot(record, folder / "curve.png")
    return table
