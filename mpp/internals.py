"""Other libraries' private parts that mpp relies on, each where no public way does the same, in this one
module: what it touches, why, and a probe (`changed`) that tests/test_internals.py runs, so that a new
release that moves one fails there by name instead of silently somewhere else.

Everything else in mpp uses the libraries' public interfaces. The versions these were read on are those
of requirements.lock (`make install` installs them).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytorch_lightning.cli import LightningArgumentParser, LightningCLI


def train_loader_loaded(fit_loop: Any) -> bool:
    """Whether Lightning's fit loop holds its train loader (`fit_loop._combined_loader`)."""
    return fit_loop._combined_loader is not None


def drop_train_loader(fit_loop: Any) -> None:
    """Make Lightning's fit loop load its train loader again (`_combined_loader`, `_data_fetcher`).

    Lightning counts a run's steps (`trainer.estimated_stepping_batches`) by loading the train loader
    before it restores a checkpoint being resumed, and then never gives that loader the checkpoint's
    state for it (Lightning issue #20550): the epoch would start afresh. Dropped, the loader is loaded
    again after the restore, with its state.
    """
    if fit_loop._data_fetcher is not None:
        fit_loop._data_fetcher.teardown()
        fit_loop._data_fetcher = None
    fit_loop._combined_loader = None


def gcs_request_once() -> Callable[..., Any]:
    """gcsfs's request without its retry decorator (`GCSFileSystem._request.__wrapped__`).

    gcsfs retries each request 6 times with its own backoff, and no argument changes that; mpp retries
    a shard read itself, resuming where it stopped (mpp.data.remote), and a retry inside a retry would
    wait minutes before an error names the shard.
    """
    import gcsfs

    return gcsfs.GCSFileSystem._request.__wrapped__


def drop_unset_anonymous(logger: Any) -> None:
    """Leave `anonymous` out of the arguments Lightning's WandbLogger gives wandb.init (`_wandb_init`)
    where it is None: wandb warns that the setting has no effect whenever it is given at all, and the
    logger passes it always."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]


def quiet_run(run: Any) -> None:
    """Set a started W&B run's `quiet` setting (`run._settings`): wandb has no public way to change a
    started run's settings, and `quiet` leaves out its closing lines (mpp.outputs.wandb_run.finish_quietly)."""
    settings = getattr(run, "_settings", None)
    if settings is not None and hasattr(settings, "quiet"):
        settings.quiet = True


def open_progress_bars() -> list[Any]:
    """tqdm's progress bars not closed yet (`tqdm._instances`): a failed run leaves them open, and the
    error line that follows would start on the same line. tqdm lists them nowhere else."""
    from tqdm import tqdm

    return list(getattr(tqdm, "_instances", ()))


class SubcommandParsers(LightningCLI):
    """LightningCLI with a hook on each subcommand's parser (`subcommand_parser`), which Lightning builds in
    its private `_prepare_subcommand_parser`: its public `add_arguments_to_parser` is not told which
    subcommand a parser is for, and `mpp predict` alone takes `--predictions.*`."""

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        self.subcommand_parser(subcommand, parser)
        return parser

    def subcommand_parser(self, subcommand: str, parser: LightningArgumentParser) -> None:
        """Add to the parser of `subcommand`."""


@dataclass(frozen=True)
class Reliance:
    """One private part mpp relies on: whose, which, where in mpp, and a probe that is empty while it holds."""

    library: str
    what: str
    used_by: str
    probe: Callable[[], str]  # "" while it holds, else what changed

    def problem(self) -> str:
        found = self.probe()
        return f"{self.library}: {self.what} ({self.used_by}) changed: {found}" if found else ""


def _fit_loop() -> str:
    import pytorch_lightning as pl

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    loop = trainer.fit_loop
    missing = [name for name in ("_combined_loader", "_data_fetcher") if not hasattr(loop, name)]
    return f"the fit loop has no {', '.join(missing)}" if missing else ""


def _subcommand_parsers() -> str:
    from pytorch_lightning import LightningModule

    seen = []

    class Probe(SubcommandParsers):
        def subcommand_parser(self, subcommand: str, parser: LightningArgumentParser) -> None:
            seen.append(subcommand)

    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        Probe(LightningModule, args=["fit", "--print_config"])
    missing = {"fit", "validate", "test", "predict"} - set(seen)
    return f"_prepare_subcommand_parser built no parser of {', '.join(sorted(missing))}" if missing else ""


def _gcs_request() -> str:
    import inspect

    import gcsfs

    wrapped = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)
    return "" if inspect.iscoroutinefunction(wrapped) else "GCSFileSystem._request has no __wrapped__ coroutine"


def _wandb_logger() -> str:
    from pytorch_lightning.loggers import WandbLogger

    init = getattr(WandbLogger(offline=True), "_wandb_init", None)
    return "" if isinstance(init, dict) and "anonymous" in init else "WandbLogger has no _wandb_init with anonymous"


def _wandb_run() -> str:
    """Starts an offline run. Where that started a W&B service, stops it and takes back the environment
    it set (WANDB_SERVICE): runs this process starts later must not share a service with it. A service
    that was running before (named in WANDB_SERVICE) stays: stopping it would leave its name behind."""
    import wandb

    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        run = wandb.init(mode="offline", dir=folder, settings=wandb.Settings(silent=True))
        try:
            holds = hasattr(getattr(run, "_settings", None), "quiet")
        finally:
            run.finish()
            if "WANDB_SERVICE" not in environment:
                wandb.teardown()
            os.environ.clear()
            os.environ.update(environment)
    return "" if holds else "a run has no _settings with quiet"


def _tqdm() -> str:
    from tqdm import tqdm

    bar = tqdm(total=1, disable=False, file=io.StringIO())
    try:
        return "" if bar in open_progress_bars() else "tqdm._instances does not list an open bar"
    finally:
        bar.close()


RELIED_ON = (
    Reliance("pytorch_lightning", "fit_loop._combined_loader, _data_fetcher", "mpp.train.steps.total_steps", _fit_loop),
    Reliance("pytorch_lightning", "LightningCLI._prepare_subcommand_parser", "mpp.cli.MPPCLI", _subcommand_parsers),
    Reliance("gcsfs", "GCSFileSystem._request.__wrapped__", "mpp.data.remote", _gcs_request),
    Reliance("pytorch_lightning", "WandbLogger._wandb_init", "mpp.console.quiet_wandb", _wandb_logger),
    Reliance("wandb", "Run._settings.quiet", "mpp.outputs.wandb_run.finish_quietly", _wandb_run),
    Reliance("tqdm", "tqdm._instances", "mpp.cli.end_progress_bars", _tqdm),
)


def changed() -> list[str]:
    """What no longer holds of RELIED_ON, one line each (empty: all of it holds)."""
    return [problem for reliance in RELIED_ON if (problem := reliance.problem())]
