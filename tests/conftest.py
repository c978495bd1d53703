"""What every test shares: the folders (workspace.ROOT, workspace.TESTS), the helper modules found
by name (pyproject's pytest `pythonpath`: tests/ and tools/), and a process that can reach no
W&B account: runs in the tests' own process log offline, whatever the machine's settings.

The tests mirror the package: tests/model, tests/shards, tests/data, tests/train, tests/eval;
whole runs of the CLI, the configs, the README and the tools sit at the top.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def offline_wandb() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.delenv("WANDB_API_KEY", raising=False)
        yield
