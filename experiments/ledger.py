"""A curve's (or a screen's) ledger: what its finished runs found, small enough to commit beside its results.

A curve's run folder (runs/curve) holds checkpoints and logs and stays on the machine that made it;
its ledger (ledger.json in the results folder) holds the same run folder's bookkeeping without them:
every finished job's result.json, the choices (with their times), the test set's reads and the
invocations. `restore` writes it back into an empty or partial run folder, so that the same command
on a fresh checkout goes on where the committed results stopped instead of starting over. A restored
run has its numbers but no checkpoint: its final test first makes it again (experiments.runner.needs_remake)
and records that remake's machine and validation beside its test; any other job that would start from
it fails with its name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.jobs import read_results, run_folder, test_reads

NAME = "ledger.json"


def _json(path: Path, default: Any) -> Any:
    return json.loads(path.read_text()) if path.exists() else default


def ledger_of(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The ledger of the run folder `out`, whose settings are `settings`."""
    return {
        "settings": settings,
        "results": dict(sorted(read_results(out).items())),
        "choices": _json(out / "choices.json", {}),
        "test_reads": test_reads(out),
        "attempts": _json(out / "attempts.json", []),
    }


def write_ledger(out: Path, settings: dict[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / NAME
    path.write_text(json.dumps(ledger_of(out, settings), indent=1) + "\n")
    return path


def restore(ledger: dict[str, Any], out: Path) -> list[str]:
    """Write into `out` what `ledger` holds and `out` does not: each finished job's result.json (a run
    folder that holds the same job unfinished is overruled: the ledger says it finished), the choices
    `out` has not made, the test reads and invocations it has no record of. Returns the jobs restored."""
    known = read_results(out)
    restored = []
    for name, result in ledger["results"].items():
        if name not in known:
            folder = run_folder(out, name)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "result.json").write_text(json.dumps(result, indent=1))
            restored.append(name)
    choices = _json(out / "choices.json", {})
    (out / "choices.json").write_text(json.dumps({**ledger["choices"], **choices}, indent=1))
    reads = test_reads(out)
    missing = [read for read in ledger["test_reads"] if read not in reads]
    with (out / "test_reads.jsonl").open("a") as file:
        file.writelines(json.dumps(read) + "\n" for read in missing)
    attempts = _json(out / "attempts.json", [])
    starts = {attempt["start"] for attempt in attempts}  # an invocation is its start; `out` has its latest end
    earlier = [attempt for attempt in ledger["attempts"] if attempt["start"] not in starts]
    (out / "attempts.json").write_text(json.dumps(earlier + attempts, indent=1))
    return restored


def go_on_from(path: Path, out: Path, fits: Callable[[dict[str, Any]], bool], who: str) -> None:
    """Restore into `out` the finished runs of the ledger at `path` that it lacks, if `fits` takes the
    ledger's settings: a fresh checkout goes on where the committed results stopped."""
    ledger = json.loads(path.read_text())
    if not fits(ledger["settings"]):
        raise SystemExit(f"{who}: {path} holds a {who} with other settings; choose another --results")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "settings.json").exists():
        (out / "settings.json").write_text(json.dumps(ledger["settings"], indent=1))
    restored = restore(ledger, out)
    if restored:
        print(f"{who}: {len(restored)} finished runs restored from {path} into {out}")
