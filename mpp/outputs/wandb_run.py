"""One W&B run per training run, whatever kills it: its records on disk up to each checkpoint,
and the same run continued when a fit resumes from a checkpoint.

Records on disk. wandb 0.31 hands each record to its service process (wandb-core), which keeps
the run's transaction log (`run-<id>.wandb`, what `wandb sync` uploads) in a 32 KiB block in
memory and writes it out when the block fills, when the run finishes, and every
`x_transaction_log_flush_interval` seconds (15 by default). The service runs in a session of
its own, so a SIGKILL of `mpp fit` (or of its process group) does not reach it; it sees its
parent gone within 0.1 s and stops at once without writing the block ("parent process exited,
terminating service process", "forced shutdown" in the run's `logs/debug-core.log`). A run
killed less than 15 s after the last write so loses all since: 26 steps left the 7-byte
header alone. No request of wandb's interface makes the service write the log on demand
(status, poll-exit, summary, history-step and preempting requests leave it as it was), so mpp
makes the interval short (`flush_records_often`) and, at each checkpoint, waits until the log
on disk holds the last row logged: `Run.step` (public) answers once the service holds every
earlier `log` call, and the file (`Run.settings.sync_file`, public; its format is the one
mpp.outputs.wandb_records reads) is read back until that step's history record is in it. The interval
is an experimental (`x_`) setting of wandb: should a later wandb drop it, the first wait times
out, says so, and training goes on without waiting.

The same run. A fit resumed from a checkpoint (`--ckpt_path last` or a path) gives the
WandbLogger the id of the run the checkpoint names and `resume="allow"`, unless the config or
WANDB_RUN_ID names a run: wandb then continues that run. Offline, the continuation is one
more `offline-run-<time>-<id>` folder whose run record says `resume`; `wandb sync` given all
of them (`wandb/offline-run-*`) uploads them as one run, in order of start time, each after
the steps of the last. The steps a killed run took after its last checkpoint are taken again
after the resume: both attempts' rows stay (a W&B history only grows), each under the
`trainer/global_step` it was logged at.

Offline unless W&B could log in (`choose_wandb_mode`), and without the command line in the
run's metadata where that holds a credential (`keep_arguments_out_of_wandb`). Where a fit's last
lines say where its run is and how to upload it, W&B's own closing lines, which say it again for
one folder only, are left out (`finish_quietly`).
"""

from __future__ import annotations

import logging
import netrc
import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import WandbLogger

from mpp.internals import quiet_run
from mpp.outputs.wandb_records import FILE_HEADER, read_records
from mpp.secrets import redact

log = logging.getLogger("mpp")

FLUSH_INTERVAL_S = 0.1  # each checkpoint waits up to about one interval, twice
FINISH_WAIT_S = 30.0  # how long a finished run's log may take to reach the disk
STATE_KEY = "WandbRun"


def flush_records_often() -> None:
    """Have W&B write a run's records to disk every FLUSH_INTERVAL_S seconds rather than 15,
    unless the environment says otherwise."""
    os.environ.setdefault("WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL", str(FLUSH_INTERVAL_S))


def continue_checkpointed_run(config: Any) -> None:
    """Give a fit's WandbLogger the id of the W&B run in the checkpoint it resumes from, where
    neither the logger's `id`/`version` nor WANDB_RUN_ID names a run."""
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    wandb = [logger for logger in loggers if getattr(logger, "class_path", "").endswith("WandbLogger")]
    if not wandb or config.get("ckpt_path") is None or os.environ.get("WANDB_RUN_ID"):
        return
    init = wandb[0].init_args
    if init.get("id") or init.get("version"):
        return
    path = checkpoint_to_resume(config)
    run_id = run_id_in_checkpoint(path) if path else None
    if run_id:
        # Lightning's WandbLogger resumes "allow" by default, but the CLI passes every wandb.init
        # argument it has, `resume=None` among them.
        init.id, init.resume = run_id, init.get("resume") or "allow"
        log.info(f"mpp: continuing W&B run {run_id} of {path}")


def checkpoint_to_resume(config: Any) -> str | None:
    """The file `config.ckpt_path` names, "last" resolved as Lightning does it: the newest
    `last*.ckpt` in the ModelCheckpoint folders. None for "best" and "hpc", which only the
    trainer knows."""
    if config.ckpt_path in ("best", "hpc"):
        return None
    if config.ckpt_path != "last":
        return str(config.ckpt_path)
    last = rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-(\d+))?"
    found: dict[str, float] = {}
    for callback in config.trainer.callbacks or []:
        folder = getattr(callback, "init_args", {}).get("dirpath")
        if not getattr(callback, "class_path", "").endswith("ModelCheckpoint") or folder is None:
            continue
        fs = get_filesystem(folder)
        for path in fs.ls(folder, detail=False) if fs.exists(folder) else []:
            if Path(path).suffix == ModelCheckpoint.FILE_EXTENSION and re.match(last, Path(path).stem):
                found[fs.unstrip_protocol(path) if "://" in str(folder) else path] = fs.modified(path).timestamp()
    return max(found, key=lambda path: found[path]) if found else None


def run_id_in_checkpoint(path: str) -> str | None:
    """The W&B run id a checkpoint holds (WandbRunCheckpoint's state), or None. Local files are
    memory-mapped, so that a large checkpoint costs no read of its tensors."""
    fs = get_filesystem(path)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    try:
        if local:
            checkpoint = torch.load(path.removeprefix("file://"), map_location="cpu", weights_only=True, mmap=True)
        else:
            with fs.open(path, "rb") as file:
                checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None  # Lightning says so when it loads it
    except Exception as error:  # noqa: BLE001 - a checkpoint mpp cannot read still resumes, in a new W&B run
        log.warning(f"mpp: no W&B run id read from {path} ({error}); the resumed fit starts a new W&B run")
        return None
    return checkpoint.get("callbacks", {}).get(STATE_KEY, {}).get("run_id")


class TransactionLog:
    """The last history step in a run's `.wandb` file so far, and whether the file has ended (its last
    record is the `exit` record that `finish` writes), reading on where the last look stopped."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step, self.ended = path, FILE_HEADER, -1, False

    def read(self) -> None:
        found, self.offset = read_records(self.path, self.offset)
        for record in found:
            kind = record.WhichOneof("record_type")
            if kind == "history":
                self.step = max(self.step, record.history.step.num)
            self.ended = kind == "exit"

    def last_step(self) -> int:
        self.read()
        return self.step

    def has_ended(self) -> bool:
        self.read()
        return self.ended


class WandbRunCheckpoint(pl.Callback):
    """Keeps the W&B run's id in every checkpoint, and the run's records on disk up to it: a
    checkpoint is written only once the rows logged before it are on disk, and the step after it
    starts only once the rows of its own step are (Lightning logs a step's metrics, and
    validates, after that step's checkpoint). Rank 0 only: other ranks hold placeholder loggers.

    Args:
        timeout: seconds to wait for W&B's writes beyond two flush intervals; after a wait that
            times out, waits no more.
    """

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.run: Any = None
        self.records: TransactionLog | None = None
        self.first_step = 0
        self.unwritten = False

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if not trainer.is_global_zero or not loggers:
            return
        self.run = loggers[0].experiment
        path = Path(self.run.settings.sync_file)
        if path.is_file() and self.flush_interval() != 0:  # 0: wandb writes only full blocks
            self.records, self.first_step = TransactionLog(path), self.run.step

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.id if self.run is not None else None}

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.wait_until_written()
        self.unwritten = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.unwritten:
            self.wait_until_written()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.unwritten:
            self.wait_until_written()

    def flush_interval(self) -> float:
        """Seconds between W&B's writes of the log (15 where wandb has no such setting)."""
        return getattr(self.run.settings, "x_transaction_log_flush_interval", 15.0)

    def wait_until_written(self) -> None:
        """Block until the `.wandb` file on disk holds every row logged so far."""
        self.unwritten = False
        if self.records is None:
            return
        logged = self.run.step - 1  # `step` is the next row's: the service holds every row before it
        if logged < self.first_step:
            return
        deadline = time.monotonic() + self.timeout + 2 * self.flush_interval()
        while self.records.last_step() < logged:
            if time.monotonic() > deadline:
                log.warning(
                    f"mpp: W&B wrote no records to {self.records.path} in time; a killed run may lose them "
                    "since its last write (mpp waits at checkpoints no more)"
                )
                self.records = None
                return
            time.sleep(0.02)


def finish_quietly(run: Any) -> None:
    """Finish a W&B run without W&B's closing lines, where mpp's last lines say where the run is.

    Left to the process's exit, W&B's service finishes the run and prints, whatever the run's
    settings, "You can sync this run to the cloud by running: wandb sync <folder>" (naming the last
    attempt's folder alone, where a resumed run has one per attempt) and "Find logs at:
    <folder>/logs". Finished here, the run follows its `quiet` setting: those lines go, W&B's
    warnings and errors stay, and so do, online, the run's and the project's pages, which mpp does
    not name. wandb has no public way to change a started run's settings (mpp.internals.quiet_run).

    wandb's service may write the run's last records (its last rows, the summary, the exit record)
    after `finish` returns: it returns once they are in the log on disk (up to FINISH_WAIT_S), so
    that a program running several runs in one process (a study's jobs) reads each run whole as soon
    as its command returns.
    """
    log_file = Path(run.settings.sync_file)
    quiet_run(run)
    run.finish()
    records = TransactionLog(log_file) if log_file.exists() else None
    deadline = time.monotonic() + FINISH_WAIT_S
    while records is not None and not records.has_ended():
        if time.monotonic() > deadline:
            log.warning(f"mpp: W&B had not written the end of {log_file} {FINISH_WAIT_S:g} s after the run finished")
            return
        time.sleep(0.05)


def finish_evaluation_run(trainer: pl.Trainer) -> None:
    """Finish the W&B run that a `validate` or `test` logged to when the command ends, as a fit's closing
    lines do, not when its process exits: a program that runs several in one process (a study's jobs)
    reads each run's records on disk as soon as its command returns."""
    import wandb

    wandb_logged = any(isinstance(logger, WandbLogger) for logger in trainer.loggers)
    if trainer.is_global_zero and wandb_logged and wandb.run is not None and os.environ.get("WANDB_MODE") != "disabled":
        finish_quietly(wandb.run)


def wandb_has_credentials() -> bool:
    """Whether W&B could log in: an API key in the environment or in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(path).authenticators(host or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def keep_arguments_out_of_wandb(argv: list[str]) -> None:
    """W&B records the command line with a run's metadata; where it holds a credential (a signed
    shard URL, a password), leave the metadata out (its one switch, WANDB_X_DISABLE_META)."""
    if any(redact(arg) != arg for arg in argv):
        os.environ.setdefault("WANDB_X_DISABLE_META", "true")
        log.info("mpp: the command line holds credentials: W&B records no system metadata for this run")


def choose_wandb_mode() -> str:
    """Run W&B offline unless the user chose a mode or has credentials; returns the mode."""
    if "WANDB_MODE" not in os.environ and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
    return os.environ.get("WANDB_MODE", "online")
