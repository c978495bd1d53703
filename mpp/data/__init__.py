"""Shard URLs -> decoded, augmented batches, for every rank and DataLoader worker.

    urls        shard specs -> URLs, checked when the config is read
    remote      reading s3://, gs://, http(s):// (retried, resumed) and local files
    transforms  one image's decode, crop, flip and resize
    stream      one worker's stream: shards -> samples -> shuffled, decoded batches
    workers     where each worker is, and what a dead one was doing
    loader      one split's DataLoader as the trainer iterates it
    module      ShardDataModule, the Lightning data module
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "ShardDataModule": "mpp.data.module",
    "ShardSpec": "mpp.data.module",
    "ShardLoader": "mpp.data.loader",
    "EmptyEpochError": "mpp.data.loader",
    "WorkerDiedError": "mpp.data.workers",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mpp.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
