"""Shard URLs -> decoded, augmented batches, for every rank and DataLoader worker.

urls           shard specs -> URLs, checked when the config is read
remote         reading s3://, gs://, http(s):// (retried, resumed) and local files
transforms     one image's decode, crop, flip and resize
stream         one worker's stream: shards -> samples -> shuffled, decoded batches
device_decode  decode="device": a batch's JPEGs decoded, cropped and resized on its device
workers        where each worker is, and what a dead one was doing
loader         one split's DataLoader as the trainer iterates it
module         ShardDataModule, the Lightning data module
"""

from mpp.data.loader import EmptyEpochError, ShardLoader
from mpp.data.module import ShardDataModule, ShardSpec
from mpp.data.workers import WorkerDiedError

__all__ = ["EmptyEpochError", "ShardDataModule", "ShardLoader", "ShardSpec", "WorkerDiedError"]
