"""The shard format mpp writes and reads: shard and sidecar names, the end-of-archive block, the sidecar
(the set's index: its format tag, its shards' names and sample counts, its classes)."""

from __future__ import annotations

import json
import re
import tarfile
from typing import Any

FORMAT = "mpp-shards/1"  # the sidecar's "format"
EOF_MARKER = bytes(2 * tarfile.BLOCKSIZE)  # a tar ends with two zero blocks
PREFIX = r"[A-Za-z0-9][A-Za-z0-9_-]*"  # a set's prefix: no '.', which would end a sample's key
SHARD_NAME = re.compile(rf"^(?P<prefix>{PREFIX})-\d{{6}}\.tar$")


class ShardError(Exception):
    """A source, shard or sidecar is unusable; the message names the file."""


def shard_name(prefix: str, index: int) -> str:
    """The file name of shard `index` of a set: `train-000003.tar`."""
    return f"{prefix}-{index:06d}.tar"


def shard_pattern(prefix: str, count: int) -> str:
    """The brace pattern of a set's `count` shards: `train-{000000..000009}.tar` (or the one name)."""
    if count == 1:
        return shard_name(prefix, 0)
    return f"{prefix}-{{{0:06d}..{count - 1:06d}}}.tar"


def is_shard_of(name: str, prefix: str) -> bool:
    """Whether `name` is the name of a shard of the set `prefix`: `train-000003.tar` of `train`."""
    match = SHARD_NAME.fullmatch(name)
    return match is not None and match["prefix"] == prefix


def sidecar_name(prefix: str) -> str:
    """The file name of a set's JSON sidecar: `train.json`."""
    return f"{prefix}.json"


INDEX_HINT = "give the <prefix>.json that `mpp shards write` writes beside its shards, or the tar shards"


def parse_index(text: str | bytes, where: str) -> dict[str, Any]:
    """A sidecar's JSON -> the index, checked: its format tag, and shards as {"name", "samples"} with
    plain file names (relative to the index's own location); a ShardError saying what `where` is otherwise."""
    try:
        index = json.loads(text)
    except ValueError as error:  # a UnicodeDecodeError too
        raise ShardError(f"{where} is not JSON ({error}): {INDEX_HINT}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ShardError(f'{where} is {_json_kind(index)}, not a shard index ("format": "{FORMAT}"): {INDEX_HINT}')
    shards = index.get("shards")
    if not isinstance(shards, list) or not all(_is_entry(entry) for entry in shards):
        raise ShardError(
            f'{where}: a shard index whose "shards" is not a list of {{"name": a file name beside it, '
            f'"samples": a count}}: rewrite it with `mpp shards write`'
        )
    return index


def _is_entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    name, samples = entry.get("name"), entry.get("samples")
    plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
    return plain and isinstance(samples, int) and not isinstance(samples, bool) and samples >= 0


def _json_kind(value: object) -> str:
    """What a JSON value is, in a few words: `a JSON object with keys a, b, c`."""
    if isinstance(value, dict) and "format" in value:
        return f"a JSON object of format {value['format']!r}"
    if isinstance(value, dict):
        keys = ", ".join(list(value)[:5]) + (", ..." if len(value) > 5 else "")
        return f"a JSON object with keys {keys}" if value else "an empty JSON object"
    if isinstance(value, list):
        return f"a JSON list of {len(value)} items"
    return {str: "a JSON string", bool: "a JSON boolean", type(None): "JSON null"}.get(type(value), "a JSON number")
