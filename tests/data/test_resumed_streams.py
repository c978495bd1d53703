"""A training stream stopped after any batch and resumed from its state yields exactly the batches
the stream that never stopped yields next: same images, labels and order, on 0 and 2 workers,
resampled and not, with and without a shuffle buffer, on shards of unequal sizes."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import torch
from shardkit import sample, write_shard, write_shards

from mpp.data import ShardDataModule
from mpp.data.resume import ResumeError
from mpp.data.stream import EpochPlan, ShardStream
from mpp.shards.format import shard_name, shard_pattern


def uneven_shards(folder: Path, sizes: list[int]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    first = 0
    for number, size in enumerate(sizes):
        write_shard(folder / shard_name("train", number), (sample(i) for i in range(first, first + size)))
        first += size
    return str(folder / shard_pattern("train", len(sizes)))


def module(shards: str, **kw: object) -> ShardDataModule:
    settings = {"train": shards, "batch_size": 4, "num_workers": 0, "image_size": 8, "shuffle_buffer": 16,
                "seed": 3, **kw}
    data = ShardDataModule(**settings)
    data.setup("fit")
    data.set_epoch(2, step=30)
    return data


def fingerprint(batch: dict) -> tuple[list[int], str]:
    return batch["label"].tolist(), hashlib.sha256(batch["image"].numpy().tobytes()).hexdigest()[:12]


def train(loader, stop: int | None = None) -> list[tuple[list[int], str]]:
    """The batches a training loop takes from `loader` (noting each), up to `stop` of them."""
    taken = []
    batches = iter(loader)
    for batch in batches:
        loader.trained(batch)
        taken.append(fingerprint(batch))
        if stop is not None and len(taken) == stop:
            batches.close()  # a run killed here: workers and prefetched batches are lost
            break
    return taken


CASES = {
    "in-process, resampled": {"num_workers": 0, "resampled": True, "samples_per_epoch": 64},
    "2 workers, resampled": {"num_workers": 2, "resampled": True, "samples_per_epoch": 64},
    "in-process, one pass": {"num_workers": 0},
    "2 workers, one pass": {"num_workers": 2},
    "2 workers, one pass, no buffer": {"num_workers": 2, "shuffle_buffer": 0},
    "2 workers, one pass, a buffer larger than a shard": {"num_workers": 2, "shuffle_buffer": 40},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_resumed_after_any_batch_yields_what_the_uninterrupted_one_yields(tmp_path: Path, case: str) -> None:
    shards = uneven_shards(tmp_path / "shards", [9, 14, 5, 11, 7])  # 46 samples; 2 workers read 3 and 2 shards
    kw = CASES[case]
    whole = train(module(shards, **kw).train_dataloader())
    assert len(whole) >= 10
    for stop in (1, 2, 3, len(whole) // 2, len(whole) - 1, len(whole)):
        first = module(shards, **kw).train_dataloader()
        before = train(first, stop)
        state = first.state_dict()
        resumed = module(shards, **kw).train_dataloader()
        resumed.load_state_dict(state)
        after = train(resumed)
        assert before + after == whole, f"stopped after {stop} batches"
    if not kw.get("resampled"):  # one pass: every sample once
        labels = [label for batch, _ in whole for label in batch]
        assert sorted(labels) == list(range(46))


def test_a_resumed_stream_resumes_again(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards", shards=4, per_shard=10)
    kw = {"num_workers": 2, "shuffle_buffer": 12}
    whole = train(module(shards, **kw).train_dataloader())
    taken, state = [], None
    for stop in (2, 3, 1):
        loader = module(shards, **kw).train_dataloader()
        if state is not None:
            loader.load_state_dict(state)
        taken += train(loader, stop)
        state = loader.state_dict()
    loader = module(shards, **kw).train_dataloader()
    loader.load_state_dict(state)
    assert taken + train(loader) == whole


def test_other_settings_resume_afresh_with_a_warning_naming_them(tmp_path: Path, caplog) -> None:
    shards = write_shards(tmp_path / "shards", shards=4, per_shard=10)
    first = module(shards, num_workers=2).train_dataloader()
    before = train(first, 3)
    state = first.state_dict()
    resumed = module(shards, num_workers=1, batch_size=5).train_dataloader()
    resumed.load_state_dict(state)
    with caplog.at_level(logging.WARNING):
        after = train(resumed)
    assert "num_workers: 2 -> 1" in caplog.text and "batch_size: 4 -> 5" in caplog.text
    labels = sorted(label for batch, _ in after for label in batch)
    assert labels == list(range(40)), "a fresh epoch reads every sample"
    assert before


def test_a_checkpoint_of_another_epoch_starts_this_one_afresh(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards", shards=4, per_shard=10)
    first = module(shards).train_dataloader()
    train(first, 3)
    state = first.state_dict()
    data = module(shards)
    data.set_epoch(3, step=40)
    loader = data.train_dataloader()
    loader.load_state_dict(state)
    fresh = module(shards)
    fresh.set_epoch(3, step=40)
    assert train(loader) == train(fresh.train_dataloader())


def test_shards_that_lost_the_buffered_samples_stop_the_resume_naming_it(tmp_path: Path) -> None:
    shards = uneven_shards(tmp_path / "shards", [10, 10, 10])
    first = module(shards, shuffle_buffer=20, shard_shuffle=False).train_dataloader()
    train(first, 4)
    state = first.state_dict()
    write_shard(tmp_path / "shards" / shard_name("train", 0), (sample(i) for i in range(3)))  # cut short
    resumed = module(shards, shuffle_buffer=20, shard_shuffle=False).train_dataloader()
    resumed.load_state_dict(state)
    with pytest.raises(ResumeError, match="the shards changed since the checkpoint"):
        train(resumed)


def test_the_state_holds_no_url_and_loads_with_weights_only(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards", shards=3, per_shard=10)
    loader = module(shards, num_workers=2).train_dataloader()
    train(loader, 3)
    state = loader.state_dict()
    torch.save(state, tmp_path / "state.pt")
    assert str(tmp_path) not in repr(state)
    assert torch.load(tmp_path / "state.pt", weights_only=True) == state


def test_a_worker_s_stream_is_its_settings_and_epoch_plan(tmp_path: Path) -> None:
    """The stream takes all it reads from two frozen values: built again from them it yields the same
    batches, and a plan holding the point a batch was completed at yields the batches after it."""
    shards = write_shards(tmp_path / "shards", shards=3, per_shard=10)
    settings = module(shards).train_dataloader().settings
    plan = EpochPlan(epoch=2, start_step=30)
    batches = list(ShardStream(settings, plan))
    assert [fingerprint(b) for b in ShardStream(settings, plan)] == [fingerprint(b) for b in batches]
    resumed = replace(plan, resume_points=(batches[2]["position"],))
    assert [fingerprint(b) for b in ShardStream(settings, resumed)] == [fingerprint(b) for b in batches[3:]]
    with pytest.raises(FrozenInstanceError):
        plan.epoch = 3  # type: ignore[misc]
