"""Class paths of earlier layouts -> where the classes live now, for the configs and checkpoints that
name them. `mpp` reads every config through `current_class_paths` (mpp.cli), and a checkpoint's
hyperparameters through `read_checkpoint` (mpp.model.checkpoint), so that a saved run config or a
checkpoint naming an old path runs, with a FutureWarning naming the path to write instead. Python
imports of the old module names are not mapped: they fail, and the table below names the new ones.

0.1.0, one flat package (module -> module; the classes kept their names):

    mpp.vit -> mpp.model.vit                mpp.pretrain -> mpp.train.pretrain
    mpp.corruption -> mpp.model.corruption  mpp.classify -> mpp.train.classify
    mpp.targets -> mpp.model.targets        mpp.optim -> mpp.train.optim
    mpp.images -> mpp.model.pixels          mpp.guards -> mpp.train.nonfinite_loss
    mpp.fewshot -> mpp.eval.fewshot         mpp.callbacks -> mpp.train.callbacks
    mpp.stream -> mpp.data.stream           mpp.pictures -> mpp.train.prediction_pictures
    mpp.transforms -> mpp.data.transforms   mpp.strategies -> mpp.train.strategies
    mpp.storage -> mpp.data.remote          mpp.checkpointing -> mpp.train.checkpoint_io
    mpp.tarstream -> mpp.shards.tar         mpp.wandb_run -> mpp.train.wandb_run
    mpp.sources -> mpp.shards.sources       mpp.wandb_records -> mpp.train.wandb_records
    mpp.inspection -> mpp.shards.inspector

0.2.0, files named by their subject:

    mpp.train.draws -> mpp.train.step_seeds
    mpp.train.guards -> mpp.train.nonfinite_loss
    mpp.train.pictures -> mpp.train.prediction_pictures
    mpp.train.callbacks.PredictionPictures -> mpp.train.prediction_pictures.PredictionPictures
    mpp.eval.records -> mpp.train.wandb_records
    mpp.eval.analyses.EncoderAnalysis -> mpp.eval.analysis_callback.EncoderAnalysis
    mpp.model.interop -> mpp.model.layouts (tensor names, timm's sizes), mpp.model.export (writing an
        export), mpp.model.checkpoint (config_from_timm, config_from_hf: reading one back)
    mpp.train.optim's total_steps, global_batch_size, log_interval, logging_step -> mpp.train.steps

0.3.0, what a run leaves behind apart from training:

    mpp.train.wandb_run, wandb_records, predictions, prediction_pictures, checkpoint_io -> mpp.outputs
    mpp.train.callbacks.ThroughputMonitor -> mpp.train.callbacks.ImageThroughput (Lightning has its own
        ThroughputMonitor)
"""

from __future__ import annotations

import warnings
from typing import Any

MOVED_MODULES = {
    "mpp.vit": "mpp.model.vit",
    "mpp.corruption": "mpp.model.corruption",
    "mpp.targets": "mpp.model.targets",
    "mpp.images": "mpp.model.pixels",
    "mpp.pretrain": "mpp.train.pretrain",
    "mpp.classify": "mpp.train.classify",
    "mpp.optim": "mpp.train.optim",
    "mpp.guards": "mpp.train.nonfinite_loss",
    "mpp.callbacks": "mpp.train.callbacks",
    "mpp.pictures": "mpp.outputs.prediction_pictures",
    "mpp.strategies": "mpp.train.strategies",
    "mpp.checkpointing": "mpp.outputs.checkpoint_io",
    "mpp.wandb_run": "mpp.outputs.wandb_run",
    "mpp.fewshot": "mpp.eval.fewshot",
    "mpp.wandb_records": "mpp.outputs.wandb_records",
    "mpp.stream": "mpp.data.stream",
    "mpp.transforms": "mpp.data.transforms",
    "mpp.storage": "mpp.data.remote",
    "mpp.tarstream": "mpp.shards.tar",
    "mpp.sources": "mpp.shards.sources",
    "mpp.inspection": "mpp.shards.inspector",
    "mpp.train.draws": "mpp.train.step_seeds",
    "mpp.train.guards": "mpp.train.nonfinite_loss",
    "mpp.train.pictures": "mpp.outputs.prediction_pictures",
    "mpp.eval.records": "mpp.outputs.wandb_records",
    "mpp.train.wandb_run": "mpp.outputs.wandb_run",
    "mpp.train.wandb_records": "mpp.outputs.wandb_records",
    "mpp.train.predictions": "mpp.outputs.predictions",
    "mpp.train.prediction_pictures": "mpp.outputs.prediction_pictures",
    "mpp.train.checkpoint_io": "mpp.outputs.checkpoint_io",
}
# Classes that left the module they shared with others (after the module's own move, if any).
MOVED_CLASSES = {
    "mpp.train.callbacks.PredictionPictures": "mpp.outputs.prediction_pictures.PredictionPictures",
    "mpp.train.callbacks.ThroughputMonitor": "mpp.train.callbacks.ImageThroughput",
    "mpp.eval.analyses.EncoderAnalysis": "mpp.eval.analysis_callback.EncoderAnalysis",
}
CLASS_PATH_KEYS = ("class_path", "_class_path")  # a config's, and Lightning's in a checkpoint's hyperparameters


def current_class_path(path: str) -> str:
    """A class path of an earlier layout -> the class's path now; any other path as it is."""
    module, _, name = path.rpartition(".")
    moved = f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES else path
    return MOVED_CLASSES.get(moved, moved)


def current_class_paths(value: Any, *, source: str = "the config") -> Any:
    """A config, or a checkpoint's hyperparameters, with every class path of an earlier layout replaced
    by the class's path now, each said in a FutureWarning that names `source`."""
    if isinstance(value, list):
        return [current_class_paths(item, source=source) for item in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key in CLASS_PATH_KEYS and isinstance(item, str) and current_class_path(item) != item:
            warnings.warn(
                f"{source} names {item}, which is {current_class_path(item)} now: name that instead",
                FutureWarning,
                stacklevel=2,
            )
            item = current_class_path(item)
        out[key] = current_class_paths(item, source=source)
    return out
