"""A W&B run that mpp finishes is whole on disk when `finish_quietly` returns: a program that runs several
runs in one process (a study's jobs) reads each one's records as soon as its command returns."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import wandb

from mpp.outputs import wandb_run
from mpp.outputs.wandb_records import history
from mpp.outputs.wandb_run import TransactionLog, finish_quietly


def has_ended(path: Path) -> bool:
    return TransactionLog(path).has_ended()


@pytest.fixture(scope="module")
def finished_log(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of a finished offline run's log, one row logged."""
    folder = tmp_path_factory.mktemp("wandb")
    run = wandb.init(project="mpp-test", dir=str(folder), mode="offline", reinit="finish_previous")
    run.log({"test/accuracy": 0.5})
    log_file = Path(run.settings.sync_file)
    finish_quietly(run)
    assert history(log_file.parent)[-1]["test/accuracy"] == 0.5
    return log_file.read_bytes()


class SlowRun:
    """A run whose service writes the end of its log `delay` seconds after `finish` returns (None: never)."""

    def __init__(self, log_file: Path, whole: bytes, delay: float | None) -> None:
        self.settings = SimpleNamespace(sync_file=str(log_file))
        self.whole, self.delay, self.log_file = whole, delay, log_file
        log_file.write_bytes(whole[:-1])  # the exit record not yet whole

    def finish(self) -> None:
        if self.delay is not None:
            threading.Timer(self.delay, self.log_file.write_bytes, [self.whole]).start()


def test_a_log_has_ended_only_once_its_exit_record_is_whole(finished_log: bytes, tmp_path: Path) -> None:
    path = tmp_path / "run.wandb"
    path.write_bytes(finished_log)
    assert has_ended(path)
    path.write_bytes(finished_log[:-1])
    assert not has_ended(path)


def test_finishing_waits_for_the_end_of_the_log(finished_log: bytes, tmp_path: Path) -> None:
    run = SlowRun(tmp_path / "run.wandb", finished_log, delay=0.3)
    start = time.monotonic()
    finish_quietly(run)
    assert time.monotonic() - start >= 0.3 and has_ended(run.log_file)


def test_a_log_that_never_ends_is_said_and_not_waited_for_long(
    finished_log: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(wandb_run, "FINISH_WAIT_S", 0.2)
    run = SlowRun(tmp_path / "run.wandb", finished_log, delay=None)
    with caplog.at_level(logging.WARNING, logger="mpp"):
        finish_quietly(run)
    assert "had not written the end of" in caplog.text and str(run.log_file) in caplog.text
