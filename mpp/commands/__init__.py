"""The `mpp` console script, and its commands that are not a training run: they read shards and
checkpoints and write files.

    mpp shards write folder photos/ --out shards/photos --holdout 0.1
    mpp shards inspect shards/photos/train.json --verify
    mpp export runs/demo/pretrain/checkpoints/last.ckpt --format hf --out exports/demo-hf
    mpp evaluate runs/demo/pretrain/checkpoints/last.ckpt --train ... --test ...
    mpp analyse runs/demo/pretrain/checkpoints/last.ckpt --out runs/analysis

Each module holds an `argument_parser()` and a `main(argv) -> exit code`; a failure is an exception,
which `main` here turns into the one `mpp: error: ...` line and exit code of every `mpp` command.
The Lightning runs (fit, validate, test, predict) go to mpp.cli; this module imports neither it nor
torch, so that `mpp shards inspect` starts in a fraction of a second, and each command imports what
it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NoReturn

from mpp.commands.names import COMMANDS, RUN_COMMANDS
from mpp.errors import ConfigError, debugging, exit_code, explain
from mpp.secrets import redact

DEFAULT = " (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """argparse for an `mpp` command: a usage mistake is raised as a ConfigError (one line, exit code 2)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}; `{self.prog} --help` says how to use it")


def command_parser(name: str, doc: str | None, **kwargs: object) -> CommandParser:
    """The parser of `mpp <name>`: the module docstring's first line as its description, the rest as its epilog."""
    first, _, rest = (doc or "").partition("\n")
    return CommandParser(
        prog=f"mpp {name}",
        description=first,
        epilog=rest.strip() or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,  # type: ignore[arg-type]
    )


def run_command(argv: list[str]) -> int:
    """Run `mpp <command> ...` (argv[0] is a name of COMMANDS) -> its exit code; a failure ends in one line."""
    debug = debugging(argv)
    argv = [arg for arg in argv if arg != "--traceback"]
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]))
    except (Exception, KeyboardInterrupt) as error:
        if debug:
            raise
        what = "error: " if isinstance(error, Exception) else ""
        print(redact(f"mpp: {what}{explain(error)}"), file=sys.stderr, flush=True)
        return exit_code(error)


def unknown_command(argv: list[str]) -> str | None:
    """What is wrong with a command line whose first word names no command of mpp, if it does not."""
    if not argv or argv[0].startswith("-") or argv[0] in RUN_COMMANDS or argv[0] in COMMANDS:
        return None
    known = ", ".join([*RUN_COMMANDS, *COMMANDS])
    return f"no command {argv[0]}: mpp's commands are {known}; `mpp --help` says what each does"


def main(args: list[str] | None = None) -> None:
    """Entry point of the `mpp` console script: a command of this package, or a Lightning run (mpp.cli)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in COMMANDS:
        raise SystemExit(run_command(argv))
    unknown = unknown_command(argv)
    if unknown:
        print(f"mpp: error: {unknown}", file=sys.stderr)
        raise SystemExit(2)
    from mpp.cli import main as run

    run(args)


def positive_count(value: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {value}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {value}")
    return number


def checkpoint_file(path: str) -> str:
    """A checkpoint the command line names, which must be a file: else the line that says what it is."""
    if not Path(path).exists():
        raise ConfigError(f"{path} does not exist; give a .ckpt file, e.g. runs/<run>/checkpoints/last.ckpt")
    if Path(path).is_dir():
        raise ConfigError(f"{path} is a folder; give a .ckpt file in it, e.g. {Path(path) / 'last.ckpt'}")
    return path
