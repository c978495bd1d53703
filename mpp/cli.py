"""The `mpp` console script: Lightning's CLI over any mpp module and the shard data module.

    mpp fit --config configs/pretrain/demo.yaml
    mpp fit --config configs/trainer/gpu.yaml --config configs/pretrain/vit_b16.yaml --trainer.max_steps 100
    mpp fit --config configs/pretrain/demo.yaml --print_config > my_run.yaml

The config's `model.class_path` picks the module (pretraining, fine-tuning, from scratch); a
mapping in a config can start from another file with `__base__` (mpp.config). The console script
enters at mpp.commands.main, which runs the commands that are not a Lightning run (`mpp shards`,
`mpp export`, `mpp evaluate`, `mpp analyse`) and refuses an unknown one before coming here.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelSummary, RichModelSummary
from pytorch_lightning.cli import (
    LightningArgumentParser,
    SaveConfigCallback,
)
from pytorch_lightning.plugins.io import CheckpointIO
from pytorch_lightning.utilities.exceptions import SIGTERMException
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from mpp.config import register_parser_mode
from mpp.console import Introduced, introduction, quiet_console, quiet_wandb
from mpp.data.classes import fill_classes
from mpp.data.module import ShardDataModule
from mpp.errors import ConfigError, debugging, exit_code, explain
from mpp.internals import SubcommandParsers, open_progress_bars
from mpp.model.checkpoint import read_checkpoint
from mpp.outputs.checkpoint_io import AtomicCheckpointIO, check_checkpoint
from mpp.outputs.predictions import PredictionWriter
from mpp.outputs.wandb_run import (
    WandbRunCheckpoint,
    choose_wandb_mode,
    continue_checkpointed_run,
    finish_evaluation_run,
    flush_records_often,
    keep_arguments_out_of_wandb,
)
from mpp.precision import run_precision
from mpp.secrets import RedactingFilter, redact, redact_tree
from mpp.summary import (
    folders_of,
    last_checkpoints,
    name_checkpoint_folders,
    results_summary,
    resume_hint,
    run_summary,
)
from mpp.train.callbacks import RankFailure
from mpp.train.reduction import RankOrderReduction

log = logging.getLogger("mpp")


class LoggedConfig(SaveConfigCallback):
    """Saves the resolved config next to the run and hands it to the loggers (W&B's config),
    with credentials in URLs and secret environment values masked (mpp.secrets)."""

    def __init__(self, parser: Any, config: Any, **kwargs: Any) -> None:
        super().__init__(parser, redact_tree(config), **kwargs)

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        config = self.parser.dump(self.config, skip_none=False, format="json")
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class MPPCLI(SubcommandParsers):
    """LightningCLI that says what it runs before fitting and where the results are after."""

    trainer_made: pl.Trainer | None = None  # this process's run: where a failure says it can resume from

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("parser_mode", register_parser_mode())
        return super().init_parser(**kwargs)

    def subcommand_parser(self, subcommand: str, parser: LightningArgumentParser) -> None:
        """predict runs a PredictionWriter and takes its `--predictions.*`."""
        if subcommand == "predict":
            parser.add_lightning_class_args(PredictionWriter, "predictions")

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config)
        # Unset: the fastest this machine computes; bf16 where the device would emulate it: 32-true (mpp.precision).
        config.trainer.precision, why = run_precision(config.trainer.precision, config.trainer.accelerator)
        self.precision_note = f" ({why})" if why else ""
        place_run_outputs(config)
        self.class_lines = fill_classes(config, self.subcommand)
        flush_records_often()
        if self.subcommand == "fit":  # validate and test log runs of their own
            continue_checkpointed_run(config)
        elif self.subcommand == "predict":  # predictions are files, not metrics: no W&B run
            config.trainer.logger = False
        # `--trainer.enable_progress_bar false` wins over the config's bar.
        if config.trainer.enable_progress_bar is False:
            config.trainer.callbacks = [
                c for c in config.trainer.callbacks or [] if not getattr(c, "class_path", "").endswith("ProgressBar")
            ]

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """The configured trainer, writing checkpoints atomically unless the config names a CheckpointIO."""
        plugins = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {}).get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        trainer = MPPCLI.trainer_made = super().instantiate_trainer(**kwargs)
        # Lightning sets `callbacks` on the trainer at run time, undeclared.
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        # Where `rich` is installed (transformers brings it), Lightning swaps its model summary for a rich
        # table; the console is the same whatever is installed: the plain one, unless the config names one.
        named = self.config.get(self.subcommand, self.config).trainer.callbacks or []
        if not any(getattr(c, "class_path", "").endswith("RichModelSummary") for c in named):
            for index, callback in enumerate(callbacks):
                if type(callback) is RichModelSummary:
                    callbacks[index] = ModelSummary()  # as Lightning makes its rich one: the default depth
        callbacks.extend([RankFailure(), WandbRunCheckpoint()])
        if not any(isinstance(callback, RankOrderReduction) for callback in callbacks):
            callbacks.append(RankOrderReduction())
        name_checkpoint_folders(trainer)
        return trainer

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.command_line = list(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand is not None:  # before Lightning reads the checkpoint's hyperparameters
            check_checkpoint(self.config[subcommand].get("ckpt_path"))

    def _parse_ckpt_path(self) -> None:
        """As Lightning's, a checkpoint's hyperparameters laid over the whole config, but read by mpp (a class
        path of an earlier layout as today's); the command line's `--model.*` laid back over them, each said."""
        before, subcommand = self.config.clone(), self.config.get("subcommand")
        self.override_lines = []
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not path or not Path(path).is_file():
            return
        hparams = dict(read_checkpoint(path).get("hyper_parameters", {}))
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        for key in model_keys(self.command_line):
            key_path = f"{subcommand}.{key}"
            if key_path not in before:
                continue
            given, saved = before[key_path], self.config[key_path]
            if given != saved:
                self.config[key_path] = given
                self.override_lines.append(f"mpp: --{key} {given} from the command line, over the checkpoint's {saved}")

    def instantiate_classes(self) -> None:
        """Build the configured objects; a value they refuse is a config error (exit code 2)."""
        try:
            super().instantiate_classes()
        except Exception as error:
            raise ConfigError(explain(error)) from error

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        quiet_wandb(self.trainer.loggers)
        # The module records its own arguments; its checkpoints also name its class where it lives now,
        # under Lightning's key, which `--ckpt_path` reads back.
        self.model.hparams["_class_path"] = f"{type(self.model).__module__}.{type(self.model).__qualname__}"

    def before_fit(self) -> None:
        self._check_data("fit")
        note = getattr(self, "precision_note", "")
        self.trainer.print(redact(run_summary(self.trainer, self.model, self.datamodule, precision_note=note)))
        self._say_overrides()
        if self._wants_last() and not last_checkpoints(self.trainer):
            self.trainer.print(
                f"mpp: --ckpt_path last: no checkpoint in {folders_of(self.trainer)}: the run starts at step 0"
            )

    def _before_evaluation(self) -> None:
        if self.subcommand == "predict" and not self.config["predict"].get("ckpt_path"):
            raise ConfigError("mpp predict needs --ckpt_path: the checkpoint to predict with (a .ckpt file, or last)")
        self._check_data(self.subcommand or "")
        if self._wants_last() and not last_checkpoints(self.trainer):
            folders = folders_of(self.trainer)
            raise ConfigError(f"--ckpt_path last: no last checkpoint in {folders}; give the checkpoint's path")
        self._say_precision()
        self._say_overrides()

    before_validate = before_test = before_predict = _before_evaluation

    def _wants_last(self) -> bool:
        return self.config[self.subcommand].get("ckpt_path") == "last"

    def _say_precision(self) -> None:
        """Evaluation prints no summary; it still says when it runs in another precision than the config's."""
        note = getattr(self, "precision_note", "")
        if "asked for" in note:
            self.trainer.print(f"mpp: precision {self.trainer.precision}{note}")

    def _check_data(self, stage: str) -> None:
        """The data module's checks, and those of the callbacks that read shards (few-shot, analyses),
        before the trainer starts its loggers (a W&B run) or workers."""
        try:
            self.datamodule.check(stage, encoder=getattr(self.model, "encoder_config", None))
            for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
                if hasattr(callback, "prepare_run") and stage == "fit":
                    callback.prepare_run(self.trainer, dict(self.datamodule.specs), self.model)
        except ValueError as error:
            raise ConfigError(str(error)) from error

    def _say_overrides(self) -> None:
        for line in [*getattr(self, "class_lines", []), *getattr(self, "override_lines", [])]:
            self.trainer.print(redact(line))

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:  # other ranks hold placeholder loggers
            self.trainer.print(redact(results_summary(self.trainer)))

    def after_validate(self) -> None:
        finish_evaluation_run(self.trainer)

    def after_test(self) -> None:
        finish_evaluation_run(self.trainer)


def place_run_outputs(config: Any) -> None:
    """Put W&B records and checkpoints under `trainer.default_root_dir` where the config does
    not say otherwise, so that `--trainer.default_root_dir` moves a whole run."""
    root = config.trainer.default_root_dir
    if root is None:
        return
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    for logger in loggers:
        wandb = getattr(logger, "class_path", "").endswith("WandbLogger")
        if wandb and logger.init_args.get("save_dir") in (None, "."):
            logger.init_args.save_dir = root
    for callback in config.trainer.callbacks or []:
        if (
            getattr(callback, "class_path", "").endswith("ModelCheckpoint")
            and callback.init_args.get("dirpath") is None
        ):
            callback.init_args.dirpath = str(Path(root) / "checkpoints")


def model_keys(argv: list[str]) -> list[str]:
    """The model settings a command line gives, as config keys: `--model.init_args.corruption.ratio 1` ->
    `model.init_args.corruption.ratio` (a key given without `init_args.` gets it)."""
    keys = []
    for arg in argv:
        if arg.startswith("--model.") and not arg.startswith("--model.class_path"):
            key = arg[2:].split("=", 1)[0]
            keys.append(key if key.startswith("model.init_args.") else key.replace("model.", "model.init_args.", 1))
    return keys


def resumed(message: str = "resume with --ckpt_path last") -> str:
    """`message`, its "resume with --ckpt_path last" told by the checkpoints the stopped run left."""
    trainer, default = MPPCLI.trainer_made, "resume with --ckpt_path last"
    return message[: -len(default)] + resume_hint(trainer) if trainer and message.endswith(default) else message


def redact_logs() -> None:
    """Mask credentials in every log line of this process and its DataLoader workers."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]
    for handler in {handler for logger in loggers for handler in getattr(logger, "handlers", [])}:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def end_progress_bars() -> None:
    """Close the progress bars a failed run left open, so that what follows starts a line of its own."""
    for bar in open_progress_bars():
        bar.close()


def main(args: list[str] | None = None) -> None:
    """A Lightning run of the `mpp` console script (mpp.commands.main): a failure ends in one line and an
    exit code."""
    argv = list(sys.argv[1:] if args is None else args)
    debug = debugging(argv)
    argv = [arg for arg in argv if arg != "--traceback"]
    if args is None:  # LightningCLI reads the command line itself, and warns when also given it
        sys.argv[1:] = argv
    quiet_console(debug=debug)
    redact_logs()
    MPPCLI.trainer_made = None
    keep_arguments_out_of_wandb([*sys.argv, *argv])
    choose_wandb_mode()
    try:
        MPPCLI(
            pl.LightningModule,
            ShardDataModule,
            subclass_mode_model=True,
            save_config_callback=LoggedConfig,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False, "description": introduction(), "formatter_class": Introduced},
            auto_configure_optimizers=False,
            args=None if args is None else argv,
        )
    except SIGTERMException as stop:  # Lightning stops between steps after a SIGTERM, with exit code 0
        end_progress_bars()
        print(f"mpp: stopped by SIGTERM; {resumed()}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from stop
    except Exception as error:
        if debug:
            raise
        rank = getattr(rank_zero_only, "rank", 0)
        where = f" (rank {rank})" if rank else ""
        end_progress_bars()
        print(redact(f"mpp: error{where}: {resumed(explain(error))}"), file=sys.stderr, flush=True)
        raise SystemExit(exit_code(error)) from None
    except KeyboardInterrupt as error:
        if debug:
            raise
        end_progress_bars()
        print(f"mpp: {resumed(explain(error))}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code(error)) from None
