"""A shard index (the <prefix>.json `mpp shards write` writes beside its shards) given where shards are
given: local, or over S3 and HTTP, it stands for the shards it lists, beside it, and an epoch of a resampled
stream is the samples it lists; a JSON that is not an index is refused saying what it is. A shard of 0 bytes
is said to be an empty file: among good shards it is skipped and counted, alone it stops the run naming it."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from shardkit import colour, read_all
from test_storage import (  # noqa: F401 - the S3 and HTTP servers and their shards, as fixtures here too
    BUCKET,
    NAMES,
    PER_SHARD,
    SHARDS,
    _same_as_disk,
    http_server,
    s3_endpoint,
    s3_env,
    shard_dir,
)
from workspace import ROOT

from mpp.cli import main
from mpp.data.classes import listed_classes_of
from mpp.data.loader import EmptyEpochError
from mpp.data.module import ShardDataModule
from mpp.data.samples import EmptyShardsError, Skips
from mpp.data.urls import ShardSet, expand_shards
from mpp.errors import ConfigError
from mpp.shards import WriteOptions, write_shards
from mpp.shards.format import FORMAT
from mpp.shards.sources import Source

COUNT, PER = 10, 4  # samples, and samples a shard: shards of 4, 4 and 2


def write_set(folder: Path) -> Path:
    """COUNT flat-colour images labelled 0.. written by mpp's writer; the index it writes beside the shards."""
    source = Source(labels=list(range(COUNT)), load=lambda i: Image.new("RGB", (12, 10), colour(i)), origin=str,
                    classes=None)
    write_shards(source, folder, "train", WriteOptions(shard_samples=PER, progress=False))
    return folder / "train.json"


def make(train: str | list[str], **options: object) -> ShardDataModule:
    return ShardDataModule(train=train, **{"batch_size": 2, "num_workers": 0, "image_size": 6, **options})


def test_a_local_index_stands_for_its_shards_and_their_samples(tmp_path: Path) -> None:
    index = write_set(tmp_path / "set")
    shards = [str(tmp_path / "set" / f"train-{i:06d}.tar") for i in range(3)]
    assert expand_shards(str(index)) == ShardSet(shards, COUNT)
    assert expand_shards(f"file://{index}") == ShardSet(shards, COUNT)
    assert expand_shards([str(index), str(index)]) == ShardSet(shards * 2, 2 * COUNT)  # named twice, read twice
    assert expand_shards([str(index), shards[0]]).samples is None  # a tar's samples are not known before reading
    dm = make(str(index), val=str(index))
    dm.setup("fit")
    labels, skipped, _ = read_all(dm.train_dataloader())
    assert sorted(labels) == list(range(COUNT)) and skipped == 0
    assert [label for batch in dm.val_dataloader() for label in batch["label"].tolist()] == list(range(COUNT))


def test_a_resampled_epoch_is_the_samples_the_index_lists(tmp_path: Path) -> None:
    index = write_set(tmp_path / "set")
    dm = make(str(index), resampled=True)  # samples_per_epoch left unset
    dm.setup("fit")
    assert dm.samples_per_epoch == COUNT and len(dm.train_dataloader()) == COUNT // 2
    _, _, batches = read_all(dm.train_dataloader())
    assert batches == COUNT // 2
    chosen = make(str(index), resampled=True, samples_per_epoch=4)  # the config's count wins
    chosen.setup("fit")
    assert len(chosen.train_dataloader()) == 2
    with pytest.raises(ValueError, match="samples_per_epoch=None is invalid; it must be set with resampled=True"):
        make([str(index), str(tmp_path / "set" / "train-000000.tar")], resampled=True)


@pytest.mark.usefixtures("s3_env")
def test_shard_names_are_relative_to_a_remote_index(request: pytest.FixtureRequest) -> None:
    import boto3

    endpoint, server, folder = (request.getfixturevalue(name)  # test_storage's fixtures, imported above
                                for name in ("s3_endpoint", "http_server", "shard_dir"))
    index = {"format": FORMAT, "prefix": "train", "shards": [{"name": name, "samples": PER_SHARD} for name in NAMES],
             "classes": ["coat", "shirt"]}
    (folder / "train.json").write_text(json.dumps(index))
    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=BUCKET, Key="data/train.json",
                                                         Body=json.dumps(index).encode())
    url = f"s3://{BUCKET}/data/train.json"
    assert expand_shards(url) == ShardSet([f"s3://{BUCKET}/data/{name}" for name in NAMES], SHARDS * PER_SHARD)
    assert listed_classes_of(url) == (["coat", "shirt"], url)  # a classifier's classes, from the remote index
    _same_as_disk(url, folder, num_workers=0)
    host, port = server.server_address
    url = f"http://{host}:{port}/train.json"
    assert expand_shards(url).urls == [f"http://{host}:{port}/{name}" for name in NAMES]
    assert listed_classes_of(url) == (["coat", "shirt"], url)
    _same_as_disk(url, folder, num_workers=0)


def test_the_classes_come_from_the_index_a_split_names_and_must_agree(tmp_path: Path) -> None:
    """A classifier's classes from an index given as the split (beside its shards or not); two that list
    other classes are refused, naming both."""
    index = write_set(tmp_path / "set")
    assert listed_classes_of(str(index)) is None  # this index lists no classes
    listing = {**json.loads(index.read_text()), "classes": [f"c{i}" for i in range(COUNT)]}
    index.write_text(json.dumps(listing))
    assert listed_classes_of(str(index)) == (listing["classes"], str(index))
    other = tmp_path / "set" / "other.json"
    other.write_text(json.dumps({**listing, "classes": ["x", "y"]}))
    with pytest.raises(ConfigError, match=re.escape(f"{index} lists classes {listing['classes']} and {other} lists "
                                                    "['x', 'y']: name shards of one labelling")):
        listed_classes_of([str(index), str(other)])


@pytest.mark.parametrize(("content", "said"), [
    ('{"epochs": 3, "lr": 0.1}', "is a JSON object with keys epochs, lr, not a shard index"),
    ('[1, 2, 3]', "is a JSON list of 3 items, not a shard index"),
    ('{"format": "other/2", "shards": []}', "is a JSON object of format 'other/2', not a shard index"),
    ('{"format": "mpp-shards/1", "shards": [{"name": "../x.tar", "samples": 1}]}',
     'a shard index whose "shards" is not a list of {"name": a file name beside it'),
    ("not json", "is not JSON (Expecting value: line 1 column 1 (char 0))"),
])
def test_a_json_that_is_not_an_index_is_refused_saying_what_it_is(tmp_path: Path, content: str, said: str) -> None:
    path = tmp_path / "train.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(f"data.train: {path} {said}".replace(f"{path} a ", f"{path}: a "))):
        make(str(path)).setup("fit")


def test_an_index_whose_shard_is_missing_names_it(tmp_path: Path) -> None:
    index = write_set(tmp_path / "set")
    (tmp_path / "set" / "train-000001.tar").unlink()
    with pytest.raises(ConfigError, match=re.escape(f"shard {tmp_path}/set/train-000001.tar (listed in {index}) "
                                                    "does not exist")):
        make(str(index)).setup("fit")


def test_an_empty_file_among_good_shards_is_skipped_and_counted(tmp_path: Path, caplog) -> None:
    write_set(tmp_path / "set")
    empty = tmp_path / "set" / "train-000003.tar"
    empty.write_bytes(b"")
    pattern = str(tmp_path / "set" / "train-{000000..000003}.tar")
    with caplog.at_level(logging.DEBUG, logger="mpp"):
        dm = make(pattern)
        dm.setup("fit")
        labels, skipped, _ = read_all(dm.train_dataloader())
    assert sorted(labels) == list(range(COUNT)) and skipped == 1
    assert f"skipped shard {empty}: EmptyFileError: an empty file (0 bytes), not a tar" in caplog.text
    resampled = make(pattern, resampled=True, samples_per_epoch=16)
    resampled.setup("fit")
    labels, skipped, batches = read_all(resampled.train_dataloader())
    assert batches == 8 and skipped >= 1 and set(labels) <= set(range(COUNT))  # each draw of it is one skip


def test_only_empty_files_stop_the_run_naming_them(tmp_path: Path) -> None:
    empty = [tmp_path / f"train-{i:06d}.tar" for i in range(2)]
    for path in empty:
        path.write_bytes(b"")
    dm = make([str(path) for path in empty], resampled=True, samples_per_epoch=8)
    dm.setup("fit")
    with pytest.raises(EmptyShardsError, match=re.escape(
            f"every shard this stream draws from is an empty file (0 bytes): {empty[0]}, {empty[1]}; there is nothing "
            "to train on")):
        next(iter(dm.train_dataloader()))
    once = make(str(empty[0]))  # read once: the epoch ends without a batch
    once.setup("fit")
    with pytest.raises(EmptyEpochError, match=re.escape(
            f"data.train yielded no batch: its 1 shard(s) ({empty[0]}) hold no sample that could be read (empty files "
            "or tars")):
        next(iter(once.train_dataloader()))


SMALL = ["--data.batch_size", "2", "--data.num_workers", "0", "--trainer.logger", "false",
         "--trainer.enable_model_summary", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.limit_val_batches", "1"]


def fit(tmp_path: Path, capfd, monkeypatch, options: list[str]) -> tuple[int, list[str]]:
    """`mpp fit` of the demo config, small, in this process -> (exit code, the lines it printed)."""
    monkeypatch.setattr("sys.argv", ["mpp"])
    code = 0
    try:
        main(["fit", "--config", str(ROOT / "configs" / "pretrain" / "demo.yaml"), *SMALL, *options,
              "--trainer.default_root_dir", str(tmp_path / "run")])
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capfd.readouterr()
    return code, [line for line in (out + err).splitlines() if line.strip()]


def test_mpp_fit_through_an_index_takes_its_epoch_from_it(tmp_path: Path, capfd, monkeypatch) -> None:
    index = str(write_set(tmp_path / "set"))
    code, lines = fit(tmp_path, capfd, monkeypatch, ["--data.train", index, "--data.val", index,
                                                      "--data.samples_per_epoch", "null", "--trainer.max_steps", "7"])
    assert code == 0, lines[-3:]
    assert f"mpp: data train={index} val={index}" in lines
    assert lines[-1] == f"mpp: checkpoint {tmp_path}/run/checkpoints/last.ckpt (resume with --ckpt_path last)"
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    in_epoch = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert (checkpoint["global_step"], in_epoch) == (7, 2)  # an epoch of 10 samples is 5 steps: 7 = 5 + 2


def test_mpp_fit_says_what_a_wrong_file_is(tmp_path: Path, capfd, caplog, monkeypatch) -> None:
    config = tmp_path / "settings.json"
    config.write_text('{"epochs": 3}')
    code, lines = fit(tmp_path, capfd, monkeypatch, ["--data.train", str(config)])
    assert code == 2
    assert lines[-1] == (f'mpp: error: data.train: {config} is a JSON object with keys epochs, not a shard index '
                         '("format": "mpp-shards/1"): give the <prefix>.json that `mpp shards write` writes beside '
                         'its shards, or the tar shards')
    monkeypatch.setattr(Skips, "warned", False)  # the first skip of a process is a warning
    zero = tmp_path / "train-000000.tar"
    zero.write_bytes(b"")
    code, lines = fit(tmp_path, capfd, monkeypatch, ["--data.train", str(zero), "--trainer.max_steps", "2"])
    assert code == 1
    assert lines[-1].startswith(f"mpp: error: every shard this stream draws from is an empty file (0 bytes): {zero}; "
                                "there is nothing to train on"), lines[-3:]
    assert f"skipped shard {zero}: EmptyFileError: an empty file (0 bytes)" in caplog.text  # on the console: stderr
