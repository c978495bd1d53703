"""A run on shards of the user's own classes: the classifier's classes from the shards' index where the
config names none, a config that names others refused naming both, and every config error found before
the run starts W&B (exit code 2, the error line last)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonargparse import Namespace
from shardkit import sample, write_shard
from workspace import ROOT

from mpp import ImageClassifier, OptimizerConfig
from mpp.cli import main
from mpp.data.classes import fill_classes
from mpp.errors import ConfigError
from mpp.model.vit import ViTConfig
from mpp.shards.format import FORMAT

SHAPES = ["circle", "square", "triangle"]


def shard_set(folder: Path, prefix: str, classes: list[str] | None) -> str:
    """One labelled shard and its index, as `mpp shards write` writes them; its pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / f"{prefix}-000000.tar", [sample(i) for i in range(3)])
    index = {"format": FORMAT, "prefix": prefix, "shards": [{"name": f"{prefix}-000000.tar", "samples": 3}]}
    (folder / f"{prefix}.json").write_text(json.dumps({**index, "classes": classes}))
    return str(folder / f"{prefix}-000000.tar")


def config(train: str, **model: object) -> Namespace:
    init = Namespace(num_classes=None, class_names=None, **model)
    return Namespace(model=Namespace(class_path="mpp.ImageClassifier", init_args=init), data=Namespace(train=train))


def test_a_classifier_takes_its_classes_from_the_index_where_the_config_names_none(tmp_path: Path) -> None:
    run = config(shard_set(tmp_path, "train", SHAPES))
    assert fill_classes(run, "fit") == [f"mpp: 3 classes from {tmp_path / 'train.json'}: circle, square, triangle"]
    assert run.model.init_args.num_classes == 3 and run.model.init_args.class_names == SHAPES
    named = config(shard_set(tmp_path, "train", SHAPES))
    named.model.init_args.num_classes = 3  # a count that agrees: the index names them
    assert fill_classes(named, "fit") == [] and named.model.init_args.class_names == SHAPES


@pytest.mark.parametrize("setting", [{"num_classes": 10}, {"class_names": ["a", "b", "c"]}])
def test_a_config_that_names_other_classes_than_the_index_is_refused_naming_both(tmp_path: Path, setting) -> None:
    run = config(shard_set(tmp_path, "train", SHAPES))
    for key, value in setting.items():
        run.model.init_args[key] = value
    with pytest.raises(ConfigError, match=r"are not the 3 classes .*train\.json lists \(circle, square, triangle\)"):
        fill_classes(run, "fit")


def test_shards_without_an_index_leave_the_classes_to_the_config(tmp_path: Path) -> None:
    run = config(shard_set(tmp_path, "train", None))  # an index without classes: unlabelled, or another tool's
    assert fill_classes(run, "fit") == [] and run.model.init_args.num_classes is None
    with pytest.raises(ValueError, match="num_classes is unset and no shard index lists the classes"):
        ImageClassifier(encoder=ViTConfig(image_size=8, patch_size=4, dim=8, depth=1, heads=1, mlp_dim=8),
                        optimizer=OptimizerConfig(name="sgd", lr=0.1))


def test_indexes_that_list_different_classes_are_refused(tmp_path: Path) -> None:
    first, second = shard_set(tmp_path / "a", "train", SHAPES), shard_set(tmp_path / "b", "train", ["x", "y"])
    with pytest.raises(ConfigError, match="lists classes .* and .* lists"):
        fill_classes(config([first, second]), "fit")


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "fashion-mnist").symlink_to(ROOT / "shards" / "fashion-mnist")
    photos = tmp_path / "photos" / "cat"
    photos.mkdir(parents=True)
    write_shard(tmp_path / "unused.tar", [])  # not a shard set: photos/ holds images
    (photos / "a.png").write_bytes(sample(0)["png"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return tmp_path


@pytest.mark.parametrize(("options", "said"), [
    (["--data.image_size", "32"], "data.image_size=32 does not fit the encoder's model.init_args.encoder.image_size=28"),
    (["--data.train", "photos"], "it holds images, not shards: write shards from them with `mpp shards write "
                                 "folder photos --out shards/<name> --holdout 0.1`"),
    (["--data.val", "null"], "FewShotEvaluation: the run has no data.train and data.val (or data.test) to evaluate on"),
])
def test_a_config_error_stops_the_run_before_wandb_starts(user: Path, capsys, options: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/pretrain/demo.yaml", "--trainer.default_root_dir", "run", *options])
    assert stop.value.code == 2
    lines = [line for line in (capsys.readouterr().err).splitlines() if line.strip()]
    assert lines[-1].startswith("mpp: error: ") and said in lines[-1], lines[-3:]
    assert not (user / "run" / "wandb").exists()  # no W&B run was started
