"""Shards without torch: the format, the tar reader, image sources, the writer, the inspector.

format     shard and sidecar names, the end-of-archive block, the sidecar's tag, ShardError
images     which members are images; any PIL mode as 8 bits per channel
tar        a streaming tar reader that groups members into samples
sources    image sets to write: FashionMNIST IDX files, CIFAR pickles, image folders
writer     write_shards: a source -> numbered tar shards and a JSON sidecar
inspector  count, describe and verify shards
"""

from mpp.shards.writer import (
    WriteOptions,
    encode_image,
    holdout_split,
    storable,
    write_shards,
    write_split,
)

__all__ = ["WriteOptions", "encode_image", "holdout_split", "storable", "write_shards", "write_split"]
