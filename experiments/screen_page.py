"""The screen's page (experiments.screen): its record as one JSON-able mapping (`summarise`) and its
table (`render`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.curve_plan import LABELS
from experiments.jobs import read_results, test_reads
from experiments.report import machine_counts
from experiments.timing import elapsed


def summarise(
    settings: dict[str, Any], rows: list[dict[str, Any]], ended: bool, out: Path, command: str
) -> dict[str, Any]:
    """A screen's record: its settings (Screen.as_dict), the rows of the values tried so far and whether it
    has ended (ScreenPlan.screen), what each arm kept, and what the runs under `out` ran on and took."""
    results = read_results(out)
    recipes = {arm: {row["lever"]: row["value"] for row in rows if row["arm"] == arm and row["chosen"]}
               for arm in settings["levers"]}  # fmt: skip
    attempts = json.loads((out / "attempts.json").read_text()) if (out / "attempts.json").exists() else []
    return {
        "command": command, "settings": settings, "rows": rows, "kept": recipes, "ended": ended,
        "machines": machine_counts(results), "test_reads": len(test_reads(out)),
        "wall_hours": elapsed(attempts) / 3600, "invocations": len(attempts),
        "run_hours": sum(result["wall_seconds"] for result in results.values()) / 3600,
    }  # fmt: skip


def render(record: dict[str, Any]) -> str:
    """The screen's table: a row per value tried, and what was kept."""
    settings = record["settings"]
    overrides = settings["study"]["overrides"]
    precision = overrides[overrides.index("--trainer.precision") + 1]
    lines = [
        f"Made by `{record['command']}`. Seed 0; validation top-1 at the last step on the held-out split "
        f"({settings['study']['splits']['val']}); MPP pretrained {settings['pretrain_steps']:,} steps, "
        f"every run at {LABELS:,} labels. Each value's lr is the best of its own grid.",
        "",
        "Runs computed on: "
        + "; ".join(f"{k}: {n} runs" for k, n in record["machines"].items())
        + f" (the precision the CPU would take; every run here is {precision}).",
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
