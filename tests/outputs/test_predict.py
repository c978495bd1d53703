"""`mpp predict`: every sample of the shards once, in shard order, with its key, on one rank or two; a
pretraining checkpoint's class tokens as the frozen encoder computes them, a classifier's probabilities
and classes; what predict.json says; the one-line errors; the split it reads where data.predict is unset."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from shardkit import sample, write_shard
from workspace import NO_BF16, ROOT, console_script, environment, run

from mpp import ImageClassifier, MaskedPatchPretraining, OptimizerConfig, ViTConfig
from mpp.cli import main
from mpp.data.module import ShardDataModule
from mpp.model.pixels import to_unit_range
from mpp.shards.format import shard_name, shard_pattern

TINY = ViTConfig(image_size=16, patch_size=4, channels=3, dim=16, depth=2, heads=2, mlp_dim=32)
SIZES = [5, 6, 4]  # 15 samples in 3 shards: 9 on rank 0 (shards 0 and 2), 6 on rank 1, in batches of 4
CLASSES = ["cat", "dog", "owl"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """Unlabelled shards of SIZES samples, each a flat colour of its own -> (their pattern, keys in shard order)."""
    folder = tmp_path_factory.mktemp("shards")
    keys, index = [], 0
    for number, size in enumerate(SIZES):
        records = [sample(i, labelled=False, size=(20, 18)) for i in range(index, index + size)]
        for record in records:  # keys that sort otherwise than the shards: the order comes from the shards
            record["__key__"] = f"{'zyx'[number]}-{record['__key__']}"
        keys += [record["__key__"] for record in records]
        write_shard(folder / shard_name("photos", number), records)
        index += size
    return str(folder / shard_pattern("photos", len(SIZES))), keys


def checkpoint(path: Path, model: torch.nn.Module) -> Path:
    """`model` perturbed away from its initial weights (a zero class token, a zero head), saved as the CLI does."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    hparams = {**model.hparams, "_class_path": f"mpp.{type(model).__name__}"}
    saved = {"state_dict": model.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": "2.6.0"}
    model.on_save_checkpoint(saved)
    torch.save(saved, path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    adamw = OptimizerConfig(name="adamw", lr=1e-3)
    return {
        "pretrain": checkpoint(folder / "pretrain.ckpt", MaskedPatchPretraining(encoder=TINY, optimizer=adamw)),
        "classify": checkpoint(
            folder / "classify.ckpt",
            ImageClassifier(encoder=TINY, optimizer=adamw, num_classes=3, class_names=CLASSES),
        ),
    }


def predict(config: str, ckpt: Path, shards: str, out: Path, *extra: str) -> str:
    """`mpp predict` of a shipped run config, as on a CPU without bf16 (so the machine's precision is
    float32), into `out` -> its console."""
    argv = [console_script("mpp"), "predict", "--config", config, "--ckpt_path", str(ckpt), "--data.predict", shards,
            "--data.batch_size", "4", "--data.num_workers", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(out.parent / "run"), "--predictions.out", str(out), *extra]
    result, _ = run(argv, ROOT, env=environment(**NO_BF16), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def images(shards: str) -> torch.Tensor:
    """The shards' images as the evaluation transform gives them, in shard order: (N, C, H, W) uint8."""
    data = ShardDataModule(test=shards, batch_size=4, num_workers=0, eval_crop_fraction=1.0)
    data.setup("test", encoder=TINY)
    return torch.cat([batch["image"] for batch in data.test_dataloader()])


def loaded(model: type, path: Path) -> torch.nn.Module:
    saved = torch.load(path, weights_only=True)
    module = model(**{k: v for k, v in saved["hyper_parameters"].items() if k != "_class_path"})
    module.load_state_dict(saved["state_dict"])
    return module.eval()


@pytest.fixture(scope="module")
def class_tokens(shards: tuple[str, list[str]], checkpoints: dict[str, Path]) -> np.ndarray:
    """The pretraining checkpoint's frozen encoder on the shards' images, in shard order, computed here."""
    module = loaded(MaskedPatchPretraining, checkpoints["pretrain"])
    with torch.no_grad():  # y = LN(z_L^0), as few-shot evaluation and the exports take it
        return module.encoder(module.normalise(to_unit_range(images(shards[0])))).numpy()


def docs_snippet() -> str:
    """The numpy lines of docs/training.md that load what `mpp predict` wrote."""
    section = (ROOT / "docs" / "training.md").read_text().split("## Predictions and features", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_a_pretraining_checkpoint_gives_the_frozen_encoder_s_class_tokens(
    tmp_path: Path, shards: tuple[str, list[str]], checkpoints: dict[str, Path], class_tokens: np.ndarray,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    pattern, keys = shards
    out = tmp_path / "runs" / "demo" / "features"  # where the docs' snippet reads
    console = predict("configs/pretrain/demo.yaml", checkpoints["pretrain"], pattern, out,
                      "--predictions.patch_means", "true")
    assert f"mpp: predictions of 15 samples in {out} (what each file holds: predict.json)" in console
    assert (out / "keys.txt").read_text().splitlines() == keys  # each once, in shard order
    embeddings, patch_means = np.load(out / "embeddings.npy"), np.load(out / "patch_means.npy")
    module = loaded(MaskedPatchPretraining, checkpoints["pretrain"])
    with torch.no_grad():
        pixels = module.normalise(to_unit_range(images(pattern)))
        _, patches = module.encoder.encode(module.encoder.add_positions(module.encoder.embed_patches(pixels)))
    assert embeddings.dtype == np.float32 and embeddings.shape == (15, 16)
    np.testing.assert_allclose(embeddings, class_tokens, atol=1e-5)
    np.testing.assert_allclose(patch_means, patches.mean(dim=1).numpy(), atol=1e-5)
    assert len({row.tobytes() for row in embeddings}) == 15  # every sample its own colour, its own embedding
    info = json.loads((out / "predict.json").read_text())
    assert info["checkpoint"] == str(checkpoints["pretrain"]) and info["module"].endswith("MaskedPatchPretraining")
    urls = [str(Path(pattern).parent / shard_name("photos", number)) for number in range(len(SIZES))]
    assert info["shards"] == [{"url": url, "samples": count} for url, count in zip(urls, SIZES)]
    assert info["precision"] == "32-true" and info["split"] == "data.predict" and info["samples"] == 15
    assert info["files"]["embeddings.npy"]["shape"] == [15, 16] and set(info["files"]) == {
        "keys.txt", "embeddings.npy", "patch_means.npy"}
    assert not (out / "parts").exists() and not (out.parent / "run" / "wandb").exists()  # no W&B run for files
    # The docs' numpy lines load it.
    monkeypatch.chdir(tmp_path)
    snippet: dict = {}
    exec(docs_snippet(), snippet)
    assert snippet["keys"] == keys and snippet["embeddings"].shape == (15, 16)


def test_a_classifier_gives_probabilities_and_classes_of_unlabelled_shards(
    tmp_path: Path, shards: tuple[str, list[str]], checkpoints: dict[str, Path]
) -> None:
    pattern, keys = shards
    out = tmp_path / "predicted"
    predict("configs/finetune/demo.yaml", checkpoints["classify"], pattern, out)
    assert (out / "keys.txt").read_text().splitlines() == keys
    probabilities, predictions = np.load(out / "probabilities.npy"), np.load(out / "predictions.npy")
    assert probabilities.shape == (15, 3) and predictions.shape == (15,) and predictions.dtype == np.int64
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, atol=1e-6)
    assert (probabilities.argmax(axis=1) == predictions).all()
    module = loaded(ImageClassifier, checkpoints["classify"])
    with torch.no_grad():
        expected = module(to_unit_range(images(pattern))).softmax(dim=-1)
    np.testing.assert_allclose(probabilities, expected.numpy(), atol=1e-5)
    assert len({row.tobytes() for row in probabilities}) == 15  # each sample's own, not the head's bias alone
    info = json.loads((out / "predict.json").read_text())
    assert info["classes"] == CLASSES and set(info["files"]) == {"keys.txt", "probabilities.npy", "predictions.npy"}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_several_ranks_write_every_sample_once_in_shard_order(
    tmp_path: Path, shards: tuple[str, list[str]], checkpoints: dict[str, Path], class_tokens: np.ndarray, ranks: int
) -> None:
    """3 shards of 5, 6 and 4 samples. On 2 ranks of 2 workers, rank 0 reads 9 samples, in batches of
    its two workers' shards taking turns, rank 1 reads 6 and then runs an empty batch in step; on 3, each
    rank reads a shard of its own, 5, 6 and 4 samples, in 2, 2 and 1 batches of 4; on 4, the fourth has
    no shard and runs empty batches in step."""
    pattern, keys = shards
    several = tmp_path / "several"
    predict("configs/pretrain/demo.yaml", checkpoints["pretrain"], pattern, several, "--trainer.accelerator", "cpu",
            "--trainer.devices", str(ranks), "--trainer.strategy", "ddp")
    assert (several / "keys.txt").read_text().splitlines() == keys
    np.testing.assert_allclose(np.load(several / "embeddings.npy"), class_tokens, atol=1e-5)  # as on one rank
    info = json.loads((several / "predict.json").read_text())
    assert info["ranks"] == ranks and info["samples"] == 15 and [s["samples"] for s in info["shards"]] == SIZES
    assert not (several / "parts").exists()


def error_line(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return int(exit_.value.code or 0), lines[-1]


@pytest.mark.parametrize(("given", "said"), [
    (["--ckpt_path", "missing.ckpt"], "mpp: error: --ckpt_path missing.ckpt does not exist"),
    ([], "mpp: error: mpp predict needs --ckpt_path: the checkpoint to predict with (a .ckpt file, or last)"),
    (["--ckpt_path", "{pretrain}", "--data.predict", "nowhere/photos-{{000000..000002}}.tar"],
     "mpp: error: data.predict: shard nowhere/photos-000000.tar (from 'nowhere/photos-{000000..000002}.tar') does "
     "not exist"),
])
def test_a_missing_checkpoint_or_shards_is_one_line(
    given: list[str], said: str, checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["mpp"])  # main reads these arguments, not pytest's
    argv = ["predict", "--config", str(ROOT / "configs" / "pretrain" / "demo.yaml"),
            *[arg.format(pretrain=checkpoints["pretrain"]) for arg in given],
            "--trainer.default_root_dir", str(tmp_path)]
    code, line = error_line(argv, capsys)
    assert code == 2 and line.startswith(said), line


def test_the_predict_split_is_data_predict_else_test_else_val(shards: tuple[str, list[str]]) -> None:
    pattern, keys = shards
    assert ShardDataModule(val="v.tar", test="t.tar", predict="p.tar").predict_split == "predict"
    assert ShardDataModule(val="v.tar", test="t.tar").predict_split == "test"
    assert ShardDataModule(val=pattern).predict_split == "val"
    with pytest.raises(ValueError, match=r"set data.predict \(or data.test or data.val"):
        ShardDataModule(train=pattern).setup("predict", encoder=TINY)
    data = ShardDataModule(val=pattern, batch_size=4, num_workers=0, shuffle_buffer=100)
    data.setup("predict", encoder=TINY)
    batches = list(data.predict_dataloader())
    assert [key for batch in batches for key in batch["key"]] == keys
    assert torch.cat([batch["shard"] for batch in batches]).tolist() == [0] * 5 + [1] * 6 + [2] * 4
    data.setup("validate", encoder=TINY)  # other splits' batches name no samples
    assert "key" not in next(iter(data.val_dataloader()))
