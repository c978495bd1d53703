"""The data's settings (mpp.data.config.DataConfig): the `data:` keys and `--data.*` flags are its fields,
as ShardDataModule takes them, and every bad field is named at once, where the settings are made."""

from __future__ import annotations

from dataclasses import fields

import pytest
from jsonargparse import ArgumentParser

from mpp.data.config import DataConfig
from mpp.data.module import ShardDataModule
from mpp.eval.fewshot import FewShotConfig, FewShotEvaluation


@pytest.mark.parametrize(("owner", "config"), [(ShardDataModule, DataConfig), (FewShotEvaluation, FewShotConfig)])
def test_the_config_keys_are_the_settings_fields_with_their_defaults_and_help(owner: type, config: type) -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(owner, "data")
    defaults = parser.get_defaults().data.as_dict()
    assert sorted(defaults) == sorted(field.name for field in fields(config))
    made = config()
    assert defaults == {f.name: getattr(made, f.name) for f in fields(config)}
    help_text = parser.format_help()
    assert "samples per batch on each rank" in help_text or "the neighbours that vote" in help_text


def test_every_bad_field_is_named_at_once_and_a_good_config_is_kept_as_given() -> None:
    with pytest.raises(ValueError) as raised:
        ShardDataModule(batch_size=0, crop_scale=(0.5, 2.0), image_size=(28, 28, 3), decode="gpu")
    assert str(raised.value) == "; and ".join([
        "data.batch_size=0 is invalid; it must be a positive number of samples",
        "data.image_size=(28, 28, 3) is invalid; it must be an int or (H, W), or null for the encoder's",
        "data.crop_scale=(0.5, 2.0) is invalid; it must be (min, max) in (0, 1]",
        "data.decode='gpu' is invalid; it must be \"cpu\" or \"device\"",
    ])  # fmt: skip
    data = ShardDataModule(train="s3://bucket/train-{000000..000009}.tar", batch_size=8, image_size=(32, 24))
    assert data.config.size == (32, 24) and data.batch_size == 8 and data.specs["train"].startswith("s3://")
    assert dict(data.hparams) == data.config.as_dict()  # what every logger and checkpoint holds
    with pytest.raises(TypeError):
        ShardDataModule(batch_sizes=8)  # a misspelt key is no setting


def test_the_few_shot_settings_are_checked_where_they_are_made() -> None:
    config = FewShotConfig(shots=[1, 5], probe_l2s=[1.0, 4.0], train="a.tar")
    assert config.shots == (1, 5) and config.probe_l2s == (1.0, 4.0) and config.settings.shots == (1, 5)
    with pytest.raises(ValueError, match=r"every_n_steps=0 is invalid; .* and FewShotEvaluation.shots=\(\) is invalid"):
        FewShotConfig(every_n_steps=0, shots=())
