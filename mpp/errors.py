"""What a user reads when a run fails: one line saying what is wrong, with the key or URL and what
to do, and an exit code; the traceback only on request (`MPP_DEBUG=1` or `--traceback`).

The line comes from the error that says the most: down the chain of causes, the first one
that mpp raised (an mpp error class, or raised in mpp's code), so that a bad value under
jsonargparse's "Does not validate against any of the Union subtypes" reads as the sentence of
the check that refused it, and an error that torch passed on from a DataLoader worker reads
as the worker's own message.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import traceback
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent

# The exit codes: a usage or config error as argparse exits; a stop by signal as a shell reports it.
USAGE, FAILED = 2, 1


class ConfigError(ValueError):
    """A value of the config that cannot work: the run stops before training, with the usage exit code."""


class RunStopped(RuntimeError):
    """The run was stopped by a signal (SIGTERM from a scheduler or `kill`, SIGINT from Ctrl-C)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


# The signals that ask a process to stop, as schedulers, `kill`, `timeout` and Ctrl-C send them.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def refuse_invalid(owner: str, config: object, checks: list[tuple[str, bool, str]]) -> None:
    """One ValueError naming every field of `config` whose check (name, holds, what it must be) fails,
    each as `<owner>.<name>=<value> is invalid; it must be ...`; nothing where all hold."""
    bad = [
        f"{owner}.{name}={getattr(config, name)!r} is invalid; it must be {wanted}"
        for name, ok, wanted in checks
        if not ok
    ]
    if bad:
        raise ValueError("; and ".join(bad))


def stop_signal(text: str) -> int | None:
    """The stopping signal in torch's "killed by signal: <name>." words, if any."""
    match = re.search(r"killed by signal: ([^.]+)\.", text)
    if match is None:
        return None
    return next((int(signum) for signum in STOP_SIGNALS if match.group(1) == signal.strsignal(signum)), None)


def debugging(argv: list[str]) -> bool:
    """Whether the user asked for tracebacks."""
    return os.environ.get("MPP_DEBUG", "") not in ("", "0") or "--traceback" in argv


def exit_code(error: BaseException) -> int:
    """The process's exit status for an error."""
    stopped = next((e for e in _chain(error) if isinstance(e, RunStopped)), None)
    if stopped is not None:
        return 128 + stopped.signum
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if any(_is_argument_error(e) or isinstance(e, ConfigError) for e in _chain(error)):
        return USAGE
    return FAILED


def add_note(error: BaseException, note: str) -> None:
    """Attach `note` to the error, to be shown after its message (BaseException.add_note on 3.10 too)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]


def explain(error: BaseException) -> str:
    """The one line that says what went wrong."""
    telling = _telling(error)
    text = str(telling)
    if isinstance(telling, KeyboardInterrupt):
        return "interrupted (Ctrl-C); resume with --ckpt_path last"
    if _is_argument_error(telling):
        return summarise_config_error(text)
    text = _worker_original(telling) or text
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    message = " ".join(lines) if lines else ""
    deliberate = type(telling).__module__.split(".")[0] == "mpp" or (
        _raised_by_mpp(telling) and isinstance(telling, (ValueError, OSError, RuntimeError))
    )
    if not deliberate:  # another library's error, or a slip in mpp (a KeyError, a TypeError): name its type
        message = f"{type(telling).__name__}: {message}" if message else type(telling).__name__
    notes = [
        note.removeprefix("mpp: ")
        for e in _chain(error)
        for note in getattr(e, "__notes__", ())
        if note.startswith("mpp: ")
    ]  # what mpp added on the way up (RankFailure's stage of a timeout)
    return " ".join([message, *notes])


def _chain(error: BaseException) -> list[BaseException]:
    """The error and its causes, outermost first."""
    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def _telling(error: BaseException) -> BaseException:
    """The outermost error of the chain that mpp raised (mpp's errors add context to their causes),
    else jsonargparse's parsing error, else the outermost."""
    chain = _chain(error)
    for candidate in chain:
        if _raised_by_mpp(candidate):
            return candidate
    if any(_is_argument_error(e) for e in chain):
        return next(e for e in chain if _is_argument_error(e))
    return error


def _raised_by_mpp(error: BaseException) -> bool:
    if type(error).__module__.split(".")[0] == "mpp":
        return True
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE)


def _is_argument_error(error: BaseException) -> bool:
    """jsonargparse's parsing error, an argparse.ArgumentError."""
    return isinstance(error, argparse.ArgumentError)


def raised_in_worker(error: BaseException) -> bool:
    """Whether torch re-raised an exception a worker caught ("Caught X in DataLoader worker process N")."""
    return re.match(r"Caught \w+ in DataLoader worker process \d+", str(error)) is not None


def _worker_original(error: BaseException) -> str | None:
    """The message of an error raised in a DataLoader worker, which torch re-raises as
    "Caught X in DataLoader worker process N. Original Traceback ... X: message"."""
    text = str(error)
    if not raised_in_worker(error):
        return None
    name = re.escape(type(error).__name__)
    matches = list(re.finditer(rf"^(?:[\w.]+\.)?{name}: ", text, re.MULTILINE))
    return text[matches[-1].end() :] if matches else None


# jsonargparse's words around the error that matters: the alternatives of a Union it also tried.
_NOISE = re.compile(
    r"Does not validate against any of the Union subtypes|^Subtypes:|^Errors:|^Given value|"
    r"Expected a <class 'NoneType'>"
)


def summarise_config_error(text: str) -> str:
    """jsonargparse's nested report of a bad config value -> "<full.key>: <what is wrong>".

    The report nests `Parser key "k":` and `Problem with given class_path 'C':` blocks by
    indentation; the deepest line that is not about the other alternatives of a Union is the
    error, and the blocks above it spell its key (a class path stands for `init_args`).
    """
    keys: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    best: tuple[int, str, list[str], str | None] | None = None
    for raw in text.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" -"))
        line = raw.strip().lstrip("- ").strip()
        keys = [(i, k) for i, k in keys if i < indent]
        classes = [(i, c) for i, c in classes if i < indent]
        if match := re.fullmatch(r'Parser key "([^"]+)":', line):
            keys.append((indent, match.group(1)))
        elif match := re.fullmatch(r"Problem with given class_path '([^']+)':", line):
            keys.append((indent, "init_args"))
            classes.append((indent, match.group(1)))
        elif not _NOISE.search(line) and (best is None or indent > best[0]):
            best = (indent, line, [k for _, k in keys], classes[-1][1] if classes else None)
    if best is None:
        return " ".join(text.split())
    _, line, path, class_path = best
    line = re.sub(r"<class '(?:[\w]+\.)*(\w+)'>", r"\1", line)
    key = ".".join(path)
    if match := re.match(r"unrecognized arguments: (.*)", line):
        options = [
            option.split("=", 1)[0].removeprefix("--") for option in match.group(1).split() if option.startswith("--")
        ]
        unknown = ", ".join(f"{key}.{option}" if key else option for option in options) or match.group(1)
        where = f"`mpp fit --{path[0]}.help {class_path}`" if class_path else "`mpp fit --help`"
        return f"unknown option {unknown}: {where} lists the options"
    return f"{key}: {line}" if key else line
