"""The tests' own time limits (workspace.time_limit): a reference machine's seconds, scaled by how much
slower this machine runs the tests' float32 work, so that a suite that passes on a fast CPU also passes
on a slow one (AVX2 only, emulated), only later."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import workspace


@pytest.fixture
def measured_afresh() -> Iterator[None]:
    workspace.slowdown.cache_clear()
    yield
    workspace.slowdown.cache_clear()


def test_a_slowdown_given_scales_every_limit_and_never_shortens_one(monkeypatch, measured_afresh) -> None:
    monkeypatch.setenv("MPP_TEST_SLOWDOWN", "3.5")
    assert workspace.time_limit(400) == 1400
    workspace.slowdown.cache_clear()
    monkeypatch.setenv("MPP_TEST_SLOWDOWN", "0.25")
    assert workspace.time_limit(400) == 400


def test_the_slowdown_measured_follows_the_machine_against_the_reference(monkeypatch, measured_afresh) -> None:
    monkeypatch.delenv("MPP_TEST_SLOWDOWN", raising=False)
    threads = torch.get_num_threads()
    monkeypatch.setattr(workspace, "REFERENCE_SECONDS", 1e-6)  # a machine a thousand times faster than any
    assert workspace.slowdown() > 1000
    assert torch.get_num_threads() == threads, "the measurement gives back the threads it took"
    torch.manual_seed(1)
    drawn = torch.rand(3)
    torch.manual_seed(1)
    workspace.slowdown.cache_clear()
    workspace.slowdown()
    assert torch.equal(torch.rand(3), drawn), "nor does it draw from the test's random numbers"
    workspace.slowdown.cache_clear()
    monkeypatch.setattr(workspace, "REFERENCE_SECONDS", 1e6)  # one slower than any
    assert workspace.slowdown() == 1.0
