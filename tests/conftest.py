"""What every test shares: the folders (workspace.ROOT, workspace.TESTS), the modules found by name
(pyproject's pytest `pythonpath`: the project's folder for `experiments` and `benchmarks`, and tests/
for the tests' own helpers), and a process that can reach no W&B account: runs in the tests' own
process log offline, whatever the machine's settings.

The tests mirror the package: tests/model, tests/shards, tests/data, tests/train, tests/eval,
tests/commands; whole runs of the CLI, the configs, the README, the experiments and the benchmarks
sit at the top.

`make test` runs the suite on two worker processes (pytest-xdist), a file to a worker, since a file's
tests share its module fixtures (the README's and docs' commands run in order in one user's folder). The files of
whole runs go first, longest first, so that the workers finish together; each worker and the runs it
starts take their share of the cores, not all of them each.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

LONGEST_FIRST = ["test_readme.py", "test_configs.py", "test_compare.py", "train/test_resume.py",
                 "train/test_ddp.py", "test_cli.py", "test_console.py", "test_study.py"]


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the runs a test starts inherit it
        torch.set_num_threads(threads)


def pytest_report_header(config: pytest.Config) -> str:
    from workspace import slowdown

    return f"time limits: {slowdown():.1f} x the reference machine's (tests/workspace.py, MPP_TEST_SLOWDOWN)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    tests = Path(__file__).parent

    def file_rank(item: pytest.Item) -> int:
        return rank.get(Path(item.path).relative_to(tests).as_posix(), len(rank))

    items.sort(key=file_rank)  # stable: within a file, and among the others, the order stays


@pytest.fixture(autouse=True, scope="session")
def offline_wandb() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.delenv("WANDB_API_KEY", raising=False)
        yield


@pytest.fixture(autouse=True, scope="module")
def no_wandb_service_left_running() -> Iterator[None]:
    """A W&B run started in this process leaves its service up and named in WANDB_SERVICE; a test file
    that started one stops it, so that runs started later (by this worker's next file, or by a run
    it launches) do not share it: a shared service keeps a killed run's id "in use" for its resume."""
    named_before = "WANDB_SERVICE" in os.environ
    yield
    if not named_before and "WANDB_SERVICE" in os.environ:
        import wandb

        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)
