"""The shard format mpp writes and reads: shard and sidecar names, the end-of-archive block, the sidecar's tag."""

from __future__ import annotations

import re
import tarfile

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
