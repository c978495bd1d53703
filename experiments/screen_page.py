"""The screen's page (experiments.screen): its record as one JSON-able mapping (`summarise`, with its
confirmation's numbers: `confirmed`) and its tables (`render`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.confirm_plan import ConfirmPlan
from experiments.curve_plan import LABELS
from experiments.finals import audit, numbers
from experiments.jobs import read_results, test_reads
from experiments.report import computed_on, interval, machine_counts, pct
from experiments.stats import paired
from experiments.timing import elapsed


def summarise(settings: dict[str, Any], plan: ConfirmPlan, out: Path, command: str) -> dict[str, Any]:
    """A screen's record: its settings (Screen.as_dict), the rows of the values tried so far and whether it
    has ended (ScreenPlan.screen), what each arm kept, its confirmation so far, and what the runs under
    `out` ran on and took."""
    results = read_results(out)
    _, rows, ended = plan.screen.screen(results)
    recipes = {arm: {row["lever"]: row["value"] for row in rows if row["arm"] == arm and row["chosen"]}
               for arm in settings["levers"]}  # fmt: skip
    attempts = json.loads((out / "attempts.json").read_text()) if (out / "attempts.json").exists() else []
    return {
        "command": command, "settings": settings, "rows": rows, "kept": recipes, "ended": ended,
        "confirmation": confirmed(plan, out, results),
        "machines": machine_counts(results, pinned=precision(settings)), "test_reads": len(test_reads(out)),
        "wall_hours": elapsed(attempts) / 3600, "invocations": len(attempts),
        "run_hours": sum(result["wall_seconds"] for result in results.values()) / 3600,
        "run_hours_by_part": run_hours_by_part(results),
    }  # fmt: skip


def precision(settings: dict[str, Any]) -> str:
    """The precision every run of the screen computes in (its overrides pin it)."""
    overrides = settings["study"]["overrides"]
    return overrides[overrides.index("--trainer.precision") + 1]


def run_hours_by_part(results: dict[str, dict]) -> dict[str, float]:
    """Hours of run time by part: MPP's pretraining, its fine-tuning, from scratch, and the evaluations that
    read the test set (tests, frozen encoders)."""
    parts: dict[str, float] = {}
    for name, result in results.items():
        kind = name.split("/")[1] if name.startswith(f"b{LABELS}/") else name.split("/")[0]
        part = {"pretrain": "MPP pretraining", "mpp": "MPP fine-tuning", "scratch": "from scratch"}.get(kind, "")
        part = "test-set evaluations" if result["kind"] != "fit" or not part else part
        parts[part] = parts.get(part, 0.0) + result["wall_seconds"] / 3600
    return parts


def confirmed(plan: ConfirmPlan, out: Path, results: dict[str, dict]) -> dict[str, Any] | None:
    """The confirmation's numbers so far (None before the screen has ended): the recipes, each chosen
    point's over its seeds (experiments.finals.numbers), MPP − from scratch at each budget paired over the
    seeds both have, and the audit of every test-set read."""
    found = plan.confirmation(results)
    if found is None or not found.recipes:
        return None
    choices = found.jobs(results, [])
    widened = found.widened(choices, results)
    path = out / "choices.json"
    times = json.loads(path.read_text()) if path.exists() else {}
    timed = {point: {**choice, "time": times.get(point, {}).get("time")} for point, choice in choices.items() if choice}

    def point_numbers(point: str, seeds: tuple[int, ...]) -> dict[str, Any] | None:
        choice = choices[point]
        finals = dict(zip(seeds, found.finals(point, choice["lr"], seeds)))  # type: ignore[index]
        return numbers(choice, finals, [job.name for job in found.pretraining(point, seeds)], results)  # type: ignore[arg-type]

    measured = {point: point_numbers(point, found.seeds(point, widened)) or point_numbers(point, found.c.seeds)
                for point in found.points() if choices[point]}  # fmt: skip
    points = {point: entry for point, entry in measured.items() if entry}  # each once its final runs are tested
    scratch = points.get(found.scratch() or "")
    differences = {}
    for budget in found.c.budgets:
        mpp = points.get(f"mpp/p{budget}")
        if mpp and scratch:
            a, b = ({int(k): v for k, v in p["test_accuracy_by_seed"].items()} for p in (mpp, scratch))
            differences[str(budget)] = paired(a, b).as_dict()
    return {
        "recipes": {arm: {"recipe": recipe, "lr": lr} for arm, (recipe, lr) in found.recipes.items()},
        "points": points, "differences": differences, "widened": sorted(widened),
        "test_set": audit(found, timed, test_reads(out), widened),
    }  # fmt: skip


def decimals(rows: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    """Two decimals for a lever whose values differ but print alike at one, so the page shows which won."""
    values: dict[tuple[str, str], set[float]] = {}
    for row in rows:
        values.setdefault((row["arm"], row["lever"]), set()).add(row["val_accuracy"])
    return {key: 2 if len({f"{100 * v:.1f}" for v in found}) < len(found) else 1 for key, found in values.items()}


def render(record: dict[str, Any]) -> str:
    """The screen's table: a row per value tried, and what was kept."""
    settings = record["settings"]
    lines = [
        f"Made by `{record['command']}`. Seed 0; validation top-1 at the last step on the held-out split "
        f"({settings['study']['splits']['val']}); MPP pretrained {settings['pretrain_steps']:,} steps, "
        f"every run at {LABELS:,} labels. Each value's lr is the best of its own grid.",
        "",
        computed_on(record["machines"]),
        "",
        "| arm | lever | value | lr (validation top-1 per lr) | validation top-1 | kept |",
        "|---|---|---|---|---|---|",
    ]
    digits = decimals(record["rows"])
    for row in record["rows"]:
        grid = ", ".join(f"{lr[2:]}: {100 * v:.1f}" for lr, v in row["grid"].items())
        edge = "; best at the edge" if row["edge"] else ""
        top1 = f"{100 * row['val_accuracy']:.{digits[row['arm'], row['lever']]}f}"
        lines.append(f"| {row['arm']} | {row['lever']} | {row['value']} | {row['lr']:g} ({grid}{edge}) | "
                     f"{top1} | {'yes' if row['chosen'] else ''} |")  # fmt: skip
    kept = {
        arm: ", ".join(f"{k}={v}" for k, v in values.items()) or "none yet" for arm, values in record["kept"].items()
    }
    lines += [
        "",
        "Kept so far: " + "; ".join(f"{arm}: {values}" for arm, values in kept.items()) + ".",
        "The screen has " + ("ended." if record["ended"] else "not ended: the same command goes on."),
    ]
    confirmation = record.get("confirmation")
    if confirmation is None:
        lines.append(f"Test set: read {record['test_reads']} times (the screen reads the validation split only).")
    by_part = record.get("run_hours_by_part") or {}
    parts = " (" + ", ".join(f"{part} {hours:.1f} h" for part, hours in by_part.items()) + ")" if by_part else ""
    lines.append(
        f"Wall time: {record['wall_hours']:.1f} h over {record['invocations']} invocation(s); "
        f"run time {record['run_hours']:.1f} h{parts}."
    )
    if confirmation is None:
        return "\n".join(lines)
    return "\n".join(lines + [""] + render_confirmation(confirmation, record["settings"]["confirm"]))


def render_confirmation(found: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The confirmation's table: each chosen point over its seeds, then MPP − from scratch per budget."""
    recipes = "; ".join(f"{arm} " + (", ".join(f"{k}={v}" for k, v in entry["recipe"].items())) + f" (lr {entry['lr']:g})"
                        for arm, entry in found["recipes"].items())  # fmt: skip
    widen = (
        f"; {settings['more_seeds']} more for both where MPP − from scratch held zero at "
        + " and ".join(f"{budget:,}" for budget in settings["widen"])
        + " steps"
        if settings["widen"] and settings["more_seeds"]
        else ""
    )
    lines = [
        "### Confirmation on the test set",
        "",
        f"The recipes kept: {recipes}. MPP pretrained {' and '.join(f'{b:,}' for b in settings['budgets'])} "
        f"steps, its lr chosen at each on validation (seed 0) around the screen's; from scratch at the screen's "
        f"lr. Seeds {', '.join(map(str, settings['seeds']))}" + widen + ".",
        "",
        "| point | lr (validation top-1 per lr, seed 0) | seeds | validation top-1 | test top-1 [95% interval] "
        "| k-NN | linear probe |",
        "|---|---|---|---|---|---|---|",
    ]
    for point, entry in found["points"].items():
        arm, size = point.split("/")
        name = f"MPP pretrained {int(size[1:]):,} steps" if arm == "mpp" else f"from scratch, {int(size[1:]):,} steps"
        grid = "the screen's"
        if "grid" in entry:
            grid = ", ".join(f"{lr[2:]}: {100 * v:.1f}" for lr, v in entry["grid"].items())
        test = entry["test_accuracy"]
        span = f" [{100 * test['low']:.1f}, {100 * test['high']:.1f}]" if test["low"] is not None else ""
        frozen = [pct(entry["frozen"][key]) if "frozen" in entry else "" for key in ("k-NN", "linear probe")]
        lines.append(f"| {name} | {entry['lr']:g} ({grid}) | {test['n']} | {pct(entry['validation'])} | "
                     f"{pct(test)}{span} | {frozen[0]} | {frozen[1]} |")  # fmt: skip
    if not found["points"]:
        lines.append(
            "| no point measured yet: each once its final runs are tested, after the whole screen | | | | | | |"
        )
    lines += ["", "MPP − from scratch (test top-1, paired over seeds): "
              + ("; ".join(f"pretrained {int(b):,} steps: {interval(d)}" for b, d in found["differences"].items()) or "not measured yet")
              + "."]  # fmt: skip
    audit = found["test_set"]
    problems = (
        f"with problems: {'; '.join(audit['problems'])}" if audit["problems"] else "each after its point's choice"
    )
    lines.append(f"Test set: read {audit['reads']} times, by {audit['evaluations_done']} of the {audit['evaluations']} "
                 f"final evaluations the choices so far call for, {problems}.")  # fmt: skip
    return lines
