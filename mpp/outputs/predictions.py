"""PredictionWriter: what `mpp predict` writes, every sample's key and the module's outputs, in shard order.

    <out>/keys.txt                   one sample key per line, the order of every file's rows
    <out>/embeddings.npy             a pretraining module's: the class token y = LN(z_L^0), float32 (N, D)
    <out>/patch_means.npy            with `patch_means`: the mean of its patch tokens, float32 (N, D)
    <out>/probabilities.npy          a classifier's: class probabilities, float32 (N, K)
    <out>/predictions.npy            a classifier's: the most probable class, int64 (N,)
    <out>/predict.json               what each file holds, the module, checkpoint, shards (and each one's
                                     sample count), precision and ranks

Each rank writes its rows to numbered parts (<out>/parts/rank00000.*) as its batches come, nothing held
in memory; once every rank is done, rank 0 joins the parts and removes them. Rows are in the order of the
split's shards and of the samples in each shard, whatever the ranks and workers: each shard is read by
one worker, in order, and the join sorts the rows by their shard, keeping each shard's order. Every rank
must see the folder (as every rank reads the checkpoint).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pytorch_lightning as pl
from numpy.lib.format import open_memmap
from pytorch_lightning.callbacks import BasePredictionWriter
from torch import Tensor

from mpp.data.module import ShardDataModule
from mpp.secrets import redact

log = logging.getLogger(__name__)

INFO = "predict.json"
KEYS = "keys.txt"
CHUNK = 1 << 16  # rows joined at a time


def writable_folder(folder: Path) -> Path:
    """`folder`, which must not be a file: the predictions go into files in it."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"predictions.out {folder} is a file: give a folder to write the predictions into (made if missing)"
        )
    return folder


class PredictionWriter(BasePredictionWriter):
    """Writes the outputs of a module's `predict_step` for every sample `mpp predict` reads.

    Args:
        out: the folder; null: `predictions` in the run folder (`trainer.default_root_dir`). The files of an
            earlier prediction there are replaced.
        patch_means: also write the mean of the encoder's patch tokens (a pretraining module's), beside the
            class token.
    """

    def __init__(self, *, out: str | None = None, patch_means: bool = False) -> None:
        super().__init__(write_interval="batch")
        if out is not None:
            writable_folder(Path(out))
        self.out, self.patch_means = out, patch_means
        self.folder: Path | None = None
        self._part: Part | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "predict":
            return
        if not isinstance(trainer.datamodule, ShardDataModule):  # type: ignore[attr-defined]
            raise ValueError("PredictionWriter writes the predictions of a ShardDataModule's predict split")
        if self.patch_means and "patch_means" not in getattr(pl_module, "predicted", {}):
            raise ValueError(f"predictions.patch_means: {type(pl_module).__name__} predicts no patch tokens")
        trainer.predict_loop.return_predictions = False  # written as they come, not held until the end
        # Rows are named by their keys; Lightning looks for a sampler's indices of them, which a ShardLoader has not.
        warnings.filterwarnings(
            "ignore", message="Couldn't infer the batch indices fetched from your dataloader: `ShardLoader`"
        )
        self.folder = writable_folder(Path(self.out) if self.out else Path(trainer.default_root_dir) / "predictions")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.folder is not None  # set in setup
        self._part = Part(self.folder / "parts", trainer.global_rank)

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        assert self._part is not None  # opened in on_predict_start
        outputs = {name: value for name, value in prediction.items() if self.patch_means or name != "patch_means"}
        # A rank in step with the others runs empty batches, which name no samples (mpp.data.loader).
        shards = batch["shard"].tolist() if "shard" in batch else []
        self._part.add(batch.get("key", []), shards, outputs, int(batch["skipped"]))

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._part is not None and self.folder is not None
        self._part.close()
        trainer.strategy.barrier("predictions written")
        if trainer.is_global_zero:
            samples = join_parts(self.folder, trainer.world_size, about(trainer, pl_module))
            log.info(f"mpp: predictions of {samples} samples in {self.folder} (what each file holds: {INFO})")


class Part:
    """One rank's rows: `rank<r>.keys` (shard index and key, one row a line), `rank<r>.<output>.bin` (its
    values, raw), and at close `rank<r>.json` (rows, skipped samples, each output's dtype and row shape)."""

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.stem = folder / f"rank{rank:05d}"
        self.keys: TextIO = open(f"{self.stem}.keys", "w", encoding="utf-8")
        self.values: dict[str, Any] = {}  # output name -> its open binary file
        self.shapes: dict[str, dict[str, Any]] = {}
        self.rows = self.skipped = 0

    def add(self, keys: list[str], shards: list[int], outputs: dict[str, Tensor], skipped: int) -> None:
        """One batch: its samples' keys and shard indices, each output (B, ...), the samples it skipped."""
        for name, value in outputs.items():
            array = value.detach().cpu().numpy()
            if len(array) != len(keys):
                raise ValueError(f"predict_step's {name!r} has {len(array)} rows for a batch of {len(keys)} samples")
            if name not in self.values:
                self.values[name] = open(f"{self.stem}.{name}.bin", "wb")
                self.shapes[name] = {"dtype": array.dtype.str, "shape": list(array.shape[1:])}
            self.values[name].write(np.ascontiguousarray(array).tobytes())
        self.keys.writelines(f"{shard}\t{key}\n" for shard, key in zip(shards, keys))
        self.rows += len(keys)
        self.skipped += skipped

    def close(self) -> None:
        for file in [self.keys, *self.values.values()]:
            file.close()
        info = {"rows": self.rows, "skipped": self.skipped, "outputs": self.shapes}
        Path(f"{self.stem}.json").write_text(json.dumps(info))


def about(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """What predict.json says of a prediction besides its files: module, checkpoint, shards, precision."""
    data = trainer.datamodule  # type: ignore[attr-defined]  # a ShardDataModule (PredictionWriter.setup)
    split = data.predict_split
    info: dict[str, Any] = {
        "module": f"{type(module).__module__}.{type(module).__qualname__}",
        "checkpoint": redact(str(trainer.ckpt_path)) if trainer.ckpt_path else None,
        "split": f"data.{split}",
        "shards": [redact(url) for url in data.urls[split]],
        "precision": str(trainer.precision),
        "ranks": trainer.world_size,
        "outputs": dict(getattr(module, "predicted", {})),
    }
    if getattr(module, "class_names", None) is not None:
        info["classes"] = list(module.class_names)  # type: ignore[arg-type]  # columns of probabilities.npy
    if trainer.limit_predict_batches not in (None, 1.0):
        info["limit_predict_batches"] = trainer.limit_predict_batches  # only those batches' samples
    return info


def join_parts(folder: Path, world_size: int, info: dict[str, Any]) -> int:
    """Rank 0: the parts of `world_size` ranks under `folder`/parts -> one file per output and keys.txt,
    rows in shard order, and predict.json (`info` with the files, samples and shard counts); the parts
    are removed. Returns the number of samples."""
    parts = folder / "parts"
    stems = [parts / f"rank{rank:05d}" for rank in range(world_size)]
    missing = [f"{stem}.json" for stem in stems if not Path(f"{stem}.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"predictions: rank 0 finds no part {', '.join(missing)}: the output folder must be one every rank sees"
        )
    metas = [json.loads(Path(f"{stem}.json").read_text()) for stem in stems]
    rows = [_read_keys(Path(f"{stem}.keys")) for stem in stems]
    shard = np.concatenate([shards for shards, _ in rows])
    keys = [key for _, rank_keys in rows for key in rank_keys]
    order = np.argsort(shard, kind="stable")  # by shard; within one, in the order its worker read it
    source_rank = np.repeat(np.arange(world_size), [meta["rows"] for meta in metas])[order]
    source_row = np.concatenate([np.arange(meta["rows"]) for meta in metas]).astype(np.int64)[order]
    _remove_earlier(folder)
    (folder / KEYS).write_text("".join(f"{keys[at]}\n" for at in order), encoding="utf-8")
    files: dict[str, Any] = {KEYS: {"holds": "one sample key per line, in the order of every file's rows"}}
    shapes: dict[str, Any] = next((meta["outputs"] for meta in metas if meta["outputs"]), {})
    for name, shape in shapes.items():
        dtype, row = np.dtype(shape["dtype"]), tuple(shape["shape"])
        target = open_memmap(folder / f"{name}.npy", mode="w+", dtype=dtype, shape=(len(order), *row))
        sources = [_raw(Path(f"{stem}.{name}.bin"), dtype, row, meta["rows"]) for stem, meta in zip(stems, metas)]
        for start in range(0, len(order), CHUNK):
            chunk = slice(start, start + CHUNK)
            for rank, source in enumerate(sources):
                mine = source_rank[chunk] == rank
                if mine.any():
                    target[chunk][mine] = source[source_row[chunk][mine]]
        target.flush()
        del target
        holds = info["outputs"].get(name, "")
        files[f"{name}.npy"] = {"holds": holds, "dtype": dtype.name, "shape": [len(order), *row]}
    counts = np.bincount(shard, minlength=len(info["shards"])).tolist()
    info = {key: value for key, value in info.items() if key != "outputs"}
    info["shards"] = [{"url": url, "samples": count} for url, count in zip(info["shards"], counts)]
    info.update(samples=len(order), skipped=sum(meta["skipped"] for meta in metas), files=files)
    (folder / INFO).write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(parts)
    return len(order)


def _read_keys(path: Path) -> tuple[np.ndarray, list[str]]:
    """A part's keys file -> (shard index of each row, int64 (R,), each row's key)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    pairs = [line.split("\t", 1) for line in lines]
    return np.array([int(shard) for shard, _ in pairs], dtype=np.int64), [key for _, key in pairs]


def _raw(path: Path, dtype: np.dtype, row: tuple[int, ...], rows: int) -> np.ndarray:
    """A part's raw values as (rows, *row), mapped rather than read (an empty file cannot be mapped)."""
    if rows == 0:
        return np.empty((0, *row), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(rows, *row))


def _remove_earlier(folder: Path) -> None:
    """The files an earlier prediction in `folder` wrote (its predict.json lists them), and that record."""
    record = folder / INFO
    if record.is_file():
        for name in json.loads(record.read_text()).get("files", {}):
            (folder / Path(name).name).unlink(missing_ok=True)
        record.unlink()
