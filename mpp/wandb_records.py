"""Read a W&B run's local records back: offline runs write no summary file and cannot be
queried through the W&B API until synced, but every run keeps its records in `run-*.wandb`.

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
    data = path.read_bytes()
    out, pieces, offset = [], [], FILE_HEADER
    while offset + RECORD_HEADER <= len(data):
        room = BLOCK - (offset % BLOCK)
        if room < RECORD_HEADER:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + RECORD_HEADER])
        if kind == 0 and length == 0:
            break
        body = data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        pieces.append(body)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            out.append(record)
            pieces = []
    return out


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
