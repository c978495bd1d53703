"""Shard URLs -> decoded, augmented batches, for every rank and DataLoader worker.

In the order a batch is made:
urls           shard specs -> URLs, checked when the config is read
remote         reading s3://, gs://, http(s):// (retried, resumed) and local files
samples        a worker's shards -> tar samples named by their coordinates, shuffled in a buffer
transforms     one image's decode, crop, flip and resize, to the encoder's size and channels
batches        decoded samples -> collated batches, and the Batch types
resume         a worker's resume point and its replay; the epoch state a checkpoint holds
stream         one worker's epoch: its plan (EpochPlan) and the flow above, composed
workers        where each worker is, and what a dead one was doing
loader         one split's DataLoader as the trainer iterates it, epoch by epoch
device_decode  decode="device": a batch's JPEGs decoded, cropped and resized on its device
module         ShardDataModule, the Lightning data module
classes        a labelled shard set's classes, for a classifier's config
"""

from mpp.data.batches import Batch
from mpp.data.loader import EmptyEpochError, ShardLoader
from mpp.data.module import ShardDataModule, ShardSpec
from mpp.data.workers import WorkerDiedError

__all__ = ["Batch", "EmptyEpochError", "ShardDataModule", "ShardLoader", "ShardSpec", "WorkerDiedError"]
