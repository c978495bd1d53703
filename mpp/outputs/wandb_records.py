"""Read a W&B run's local records back: offline runs write no summary file and cannot be
queried through the W&B API until synced, but every run keeps its records in `run-*.wandb`;
a run resumed by its id adds one folder per attempt (`run_folders`).

A `run-*.wandb` file is a 7-byte header, then 32 KiB blocks of records, each with a
7-byte header (CRC32 4, length 2, type 1) whose type says whether the record is whole
(1) or the first (2), a middle (3) or the last (4) piece of one spread over blocks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
FILE_HEADER = 7
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of a `.wandb` file, in order."""
    return read_records(path)[0]


def read_records(path: Path, offset: int = FILE_HEADER) -> tuple[list[wandb_internal_pb2.Record], int]:
    """The whole records of a `.wandb` file from `offset` (where a record starts) on, and the
    offset after the last of them: where to read on once a running run's file has grown. The
    file may end inside a record (wandb writes a full block at once, and a write may be under
    way): that record is left for the next read."""
    with open(path, "rb") as file:
        file.seek(offset)
        data = file.read()
    out, pieces, start, end = [], [], offset, offset
    while end + RECORD_HEADER <= offset + len(data):
        room = BLOCK - (end % BLOCK)
        if room < RECORD_HEADER:  # a block's tail too short for a header is padding
            end += room
            continue
        at = end - offset
        _, length, kind = struct.unpack("<IHB", data[at : at + RECORD_HEADER])
        if (kind == 0 and length == 0) or at + RECORD_HEADER + length > len(data):
            break
        pieces.append(data[at + RECORD_HEADER : at + RECORD_HEADER + length])
        end += RECORD_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            out.append(record)
            pieces, start = [], end
    return out, start


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The logged rows (`wandb.log` calls) of an offline run folder, values decoded from JSON."""
    (path,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                *parents, key = [item.key] if item.key else list(item.nested_key)
                place = row
                for parent in parents:  # media are logged as nested fields: key -> {"_type", ...}
                    place = place.setdefault(parent, {})
                place[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def run_folders(wandb_dir: Path, run_id: str) -> list[Path]:
    """The folders of one W&B run (a run resumed by id writes one more each time), in the order
    `wandb sync` uploads them: by the start time of the run record each holds."""
    folders = [path.parent for path in wandb_dir.glob(f"*/run-{run_id}.wandb") if not path.parent.is_symlink()]

    def start(folder: Path) -> float:  # a file that holds no run record yet (its header alone) goes first
        run = next(
            (r.run for r in records(folder / f"run-{run_id}.wandb") if r.WhichOneof("record_type") == "run"), None
        )
        return run.start_time.seconds + run.start_time.nanos * 1e-9 if run else float("-inf")

    return sorted(folders, key=start)


def run_history(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The logged rows of one W&B run over all its folders, in the order `wandb sync` uploads them."""
    return [row for folder in run_folders(wandb_dir, run_id) for row in history(folder)]


def config(run_dir: Path) -> dict[str, Any]:
    """The run's config as the last config record left it."""
    (path,) = run_dir.glob("run-*.wandb")
    values: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") in ("config", "run"):
            source = record.config if record.WhichOneof("record_type") == "config" else record.run.config
            for item in source.update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values
