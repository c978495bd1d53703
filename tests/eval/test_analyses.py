"""The Figure 7 analyses: known answers for attention distance, position similarity, filter components
and class-token maps; the explicit-attention forward against the encoder's own; the tool on tiny
checkpoints and the callback in a tiny fit."""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from shardkit import encode, write_shard
from workspace import mpp_command

from mpp import MaskedPatchPretraining, OptimizerConfig, ShardDataModule, ViT, ViTConfig
from mpp.commands.analyse import default_names
from mpp.eval.analyses import (
    analyse,
    class_token_maps,
    filter_components,
    mean_attention_distance,
    patch_attention,
    patch_centres,
    position_similarity,
    sized_images,
)
from mpp.eval.analysis_callback import EncoderAnalysis
from mpp.eval.figures import mosaic
from mpp.model.checkpoint import encoder_and_normalisation
from mpp.model.pixels import Normalise

TINY = ViTConfig(image_size=16, patch_size=4, dim=32, depth=2, heads=4, mlp_dim=64)


def perturbed(config: ViTConfig = TINY, seed: int = 0) -> ViT:
    """An encoder with every weight moved off its initial value (a zero class token or bias hides nothing)."""
    torch.manual_seed(seed)
    encoder = ViT(config)
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return encoder.eval()


def with_class_token(patches: torch.Tensor, *, to_class: float) -> torch.Tensor:
    """(B, h, N, N) attention among patches -> (B, h, 1 + N, 1 + N): every row also gives `to_class`
    to the class token (the rest scaled down to fit), and the class token's row is random."""
    batch, heads, count, _ = patches.shape
    weights = torch.rand(batch, heads, 1 + count, 1 + count).softmax(-1)
    weights[:, :, 1:, 0] = to_class
    weights[:, :, 1:, 1:] = (1 - to_class) * patches
    return weights


def test_patch_centres_sit_in_the_middle_of_each_patch_row_major():
    assert patch_centres((2, 3), (4, 2)).tolist() == [[2, 1], [2, 3], [2, 5], [6, 1], [6, 3], [6, 5]]


def test_attending_to_itself_only_is_distance_zero_whatever_goes_to_the_class_token():
    identity = torch.eye(6).expand(2, 3, 6, 6)
    weights = with_class_token(identity, to_class=0.7)
    attention = patch_attention(weights)
    torch.testing.assert_close(attention, identity)
    assert mean_attention_distance(attention, (2, 3), (4, 4)).tolist() == [0.0, 0.0, 0.0]


def test_uniform_attention_is_the_mean_distance_between_patch_centres():
    # A 2 x 2 grid of 4 px patches: centres (2, 2), (2, 6), (6, 2), (6, 6).
    d = 4 * math.sqrt(2)
    by_hand = [
        [0, 4, 4, d],
        [4, 0, d, 4],
        [4, d, 0, 4],
        [d, 4, 4, 0],
    ]
    expected = sum(map(sum, by_hand)) / 16  # = 2 + √2
    uniform = torch.full((3, 1, 4, 4), 0.25)
    identity = torch.eye(4).expand(3, 1, 4, 4)
    heads = torch.cat([identity, uniform], dim=1)  # head 0 attends to itself, head 1 to all alike
    attention = patch_attention(with_class_token(heads, to_class=0.4))
    distances = mean_attention_distance(attention, (2, 2), (4, 4))
    torch.testing.assert_close(distances, torch.tensor([0.0, expected]))
    assert distances[1].item() == pytest.approx(2 + math.sqrt(2))


def test_distance_reads_patch_height_and_width_as_the_grid_does():
    # One row of three 4 x 2 px patches: centres 2 px apart along the width.
    # Uniform: rows (0 + 2 + 4) / 3, (2 + 0 + 2) / 3, (4 + 2 + 0) / 3, mean 16 / 9.
    uniform = torch.full((1, 1, 3, 3), 1 / 3)
    assert mean_attention_distance(uniform, (1, 3), (4, 2)).item() == pytest.approx(16 / 9)
    # Attending to the next patch along the row is one patch width away (the last one, to its left).
    neighbour = torch.tensor([[0.0, 1, 0], [0, 0, 1], [0, 1, 0]]).expand(1, 1, 3, 3)
    assert mean_attention_distance(neighbour, (1, 3), (4, 2)).item() == pytest.approx(2.0)


def test_distance_is_averaged_over_the_images_of_the_batch():
    near = torch.eye(4).expand(1, 1, 4, 4)
    far = torch.eye(4).flip(-1).expand(1, 1, 4, 4)  # each patch attends to the diagonally opposite one
    distance = mean_attention_distance(torch.cat([near, far]), (2, 2), (4, 4)).item()
    assert distance == pytest.approx(4 * math.sqrt(2) / 2)


def grid_positions(grid: tuple[int, int]) -> torch.Tensor:
    """(N, gh + gw) position embeddings: one-hot row ⊕ one-hot column."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    one_hot = torch.nn.functional.one_hot
    return torch.cat([one_hot(rows.flatten(), grid[0]), one_hot(cols.flatten(), grid[1])], dim=1).float()


def expected_similarity(grid: tuple[int, int]) -> torch.Tensor:
    """([same row] + [same column]) / 2 for every pair of positions, (gh, gw, gh, gw)."""
    r, c, r2, c2 = torch.meshgrid(*(torch.arange(n) for n in (*grid, *grid)), indexing="ij")
    return ((r == r2).float() + (c == c2).float()) / 2


def test_row_and_column_embeddings_are_similar_along_their_row_and_column():
    similarity = position_similarity(grid_positions((2, 3)), (2, 3))
    assert similarity.shape == (2, 3, 2, 3)
    torch.testing.assert_close(similarity, expected_similarity((2, 3)))
    torch.testing.assert_close(similarity[1, 2], torch.tensor([[0.0, 0.0, 0.5], [0.5, 0.5, 1.0]]))  # (1, 2)'s map


def orthogonal_patterns() -> torch.Tensor:
    """(3, 3, 4, 4) orthonormal patterns, each in its own channel and layout, so that a component
    read back in another (C, P, P) order would not match."""
    ones = torch.ones(4, 4)
    halves = torch.cat([ones[:, :2], -ones[:, 2:]], dim=1)  # left minus right
    patterns = torch.zeros(3, 3, 4, 4)
    patterns[0, 0] = halves  # red: left vs right
    patterns[1, 1] = halves.T  # green: top vs bottom
    patterns[2, 2] = halves * halves.T  # blue: a 2 x 2 checkerboard
    return patterns / 4


def test_filters_built_from_orthogonal_patterns_give_those_patterns_as_components():
    patterns = orthogonal_patterns()
    # Zero-mean, orthogonal weights of 8 filters (Walsh functions), of spread 3, 2, 1.
    walsh = torch.tensor([[1, -1, 1, -1, 1, -1, 1, -1], [1, 1, -1, -1, 1, 1, -1, -1], [1, 1, 1, 1, -1, -1, -1, -1]])
    mixing = walsh.T.float() * torch.tensor([3.0, 2.0, 1.0])  # (D, 3)
    offset = torch.randn(3, 4, 4)  # a filter every filter shares: centring removes it
    weight = torch.einsum("dk,kcij->dcij", mixing, patterns) + offset
    components, explained = filter_components(weight, count=28)
    assert components.shape == (8, 3, 4, 4)  # no more components than filters
    for component, pattern in zip(components[:3], patterns):
        sign = torch.sign((component * pattern).sum())
        torch.testing.assert_close(sign * component, pattern, atol=1e-5, rtol=0)
        assert component.flatten().max() >= -component.flatten().min()  # the largest entry is positive
    torch.testing.assert_close(explained[:3], torch.tensor([9.0, 4.0, 1.0]) / 14, atol=1e-6, rtol=0)
    assert explained[3:].abs().max() < 1e-6


def test_class_token_maps_show_where_the_class_token_looks():
    weights = torch.zeros(1, 2, 7, 7)  # a 2 x 3 grid
    weights[0, 0, 0, [0, 2]] = 0.5  # head 0: half to itself, half to patch 1 at (0, 1)
    weights[0, 1, 0, 6] = 1.0  # head 1: all to patch 5 at (1, 2)
    maps = class_token_maps(weights, (2, 3))
    # Over heads: 0.25 to (0, 1), 0.5 to (1, 2); renormalised over the patches.
    torch.testing.assert_close(maps, torch.tensor([[[0.0, 1 / 3, 0.0], [0.0, 0.0, 2 / 3]]]))


def test_mosaic_lays_tiles_out_row_major_with_a_gap():
    tiles = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1, 1)
    assert mosaic(tiles, 2, fill=0.0)[..., 0].tolist() == [[1, 0, 2], [0, 0, 0], [3, 0, 0]]


def test_analyse_reads_the_encoders_own_weights_and_leaves_it_as_it_was():
    encoder = perturbed().train()
    grid = encoder.grid
    with torch.no_grad():
        encoder.pos_embed[0, 1:] = 0
        encoder.pos_embed[0, 1:, : grid[0] + grid[1]] = grid_positions(grid)
        encoder.pos_embed[0, 0] = torch.randn(TINY.dim)  # the class token's: left out
        encoder.patch_embed.weight[:, 0] = 0  # no red: no component has any
    images = torch.randint(0, 256, (5, 3, 16, 16), dtype=torch.uint8)
    analysis = analyse(encoder, images, normalise=Normalise(mean=[0.5], std=[0.25]), map_images=3, batch_size=2)
    assert encoder.training  # handed back in training mode
    torch.testing.assert_close(analysis.similarity, expected_similarity(grid))
    assert analysis.components.shape == (28, 3, 4, 4) and analysis.components[:, 0].abs().max() < 1e-6
    assert analysis.distances.shape == (TINY.depth, TINY.heads) and analysis.num_images == 5
    assert analysis.maps.shape == (3, *grid) and analysis.images.shape == (3, 3, 16, 16)
    torch.testing.assert_close(analysis.maps.sum((1, 2)), torch.ones(3))
    # In batches of 2 or all at once: the same average over the 5 images, the same maps.
    whole = analyse(encoder, images, normalise=Normalise(mean=[0.5], std=[0.25]), map_images=3, batch_size=5)
    torch.testing.assert_close(analysis.distances, whole.distances)
    torch.testing.assert_close(analysis.maps, whole.maps)
    torch.testing.assert_close(analysis.images, images[:3].float() / 255)
    numbers = json.loads(json.dumps(analysis.numbers()))
    torch.testing.assert_close(torch.tensor(numbers["attention_distance"]["per_head"]), analysis.distances)
    assert numbers["attention_distance"]["per_block"] == pytest.approx(analysis.distances.mean(1).tolist())
    assert numbers["grid"] == [4, 4] and numbers["patch_size"] == [4, 4]


def test_analyse_runs_in_float32_on_an_encoder_held_in_bf16():
    low = perturbed().bfloat16()
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    normalise = Normalise(mean=[0.5], std=[0.25])
    analysis = analyse(low, images, normalise=normalise)
    reference = analyse(copy.deepcopy(low).float(), images, normalise=normalise)
    assert next(low.parameters()).dtype == torch.bfloat16  # the encoder itself is not converted
    assert analysis.distances.dtype == torch.float32
    torch.testing.assert_close(analysis.distances, reference.distances, atol=0, rtol=0)


def noise_shards(folder: Path, count: int = 12) -> str:
    """One shard of `count` 20 x 16 px random RGB images, unlabelled."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)

    def record(index: int) -> dict:
        pixels = generator.integers(0, 256, (16, 20, 3), dtype=np.uint8)
        return {"__key__": f"noise{index:06d}", "png": encode(Image.fromarray(pixels))}

    return write_shard(folder / "noise-000000.tar", (record(i) for i in range(count)))


def checkpoint(path: Path, encoder: ViTConfig, seed: int) -> Path:
    """A pretraining checkpoint as Lightning writes one, its weights moved off their initial values."""
    torch.manual_seed(seed)
    model = MaskedPatchPretraining(encoder=encoder, optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                                   pixel_mean=[0.5], pixel_std=[0.25])
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    saved = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    model.on_save_checkpoint(saved)
    torch.save(saved, path)
    return path


def test_the_tool_analyses_several_checkpoints_each_at_its_own_size(tmp_path):
    images = noise_shards(tmp_path / "shards")
    rgb = checkpoint(tmp_path / "mpp.ckpt", TINY, seed=0)
    grey = checkpoint(tmp_path / "scratch.ckpt", ViTConfig(image_size=(8, 12), patch_size=4, dim=16, depth=3,
                                                            heads=2, mlp_dim=32, channels=1), seed=1)
    out = tmp_path / "analysis"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = mpp_command("analyse", str(rgb), str(grey), "--names", "MPP", "from scratch", "--images", images,
                           "--out", str(out), "--num-images", "6", "--map-images", "3", "--device", "cpu")
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "filters-MPP.png", "filters-from_scratch.png", "positions-MPP.png", "positions-from_scratch.png",
        "attention-distance.png", "attention-maps.png", "analysis.json"])
    for picture in out.glob("*.png"):
        pixels = np.asarray(Image.open(picture).convert("RGB"))
        assert pixels.shape[0] > 100 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10, picture.name
    numbers = json.loads((out / "analysis.json").read_text())
    mpp, scratch = numbers["encoders"]["MPP"], numbers["encoders"]["from scratch"]
    assert mpp["checkpoint"] == str(rgb) and mpp["num_images"] == 6 and mpp["grid"] == [4, 4]
    assert np.array(mpp["attention_distance"]["per_head"]).shape == (2, 4)
    assert np.array(scratch["attention_distance"]["per_head"]).shape == (3, 2) and scratch["grid"] == [2, 3]
    assert len(mpp["filters"]["explained_variance_ratio"]) == 28  # min(28, D=32, 3·4·4)
    assert len(scratch["filters"]["explained_variance_ratio"]) == 16  # D = 16 filters of 1·4·4
    # The tool's numbers are analyse's on the same images.
    encoder, normalise = encoder_and_normalisation(str(grey))
    direct = analyse(encoder, sized_images(images, encoder.config, 6), normalise=normalise)
    torch.testing.assert_close(torch.tensor(scratch["attention_distance"]["per_head"]), direct.distances)
    assert "from scratch: mean attention distance per block" in printed.getvalue()


def test_the_tool_names_checkpoints_by_the_parts_of_their_paths_that_differ():
    paths = ["runs/demo/pretrain/checkpoints/last.ckpt", "runs/demo/finetune/checkpoints/last.ckpt"]
    assert default_names(paths) == ["pretrain-last", "finetune-last"]
    assert default_names(["a/mpp.ckpt", "a/scratch.ckpt"]) == ["mpp", "scratch"]


def test_the_tool_refuses_names_that_do_not_fit_the_checkpoints(tmp_path, capsys):
    code = mpp_command("analyse", "a.ckpt", "b.ckpt", "--names", "MPP", "--images", "x.tar", "--out", str(tmp_path))
    assert code == 2 and capsys.readouterr().err == (
        "mpp: error: --names needs one name per checkpoint, distinct in file names: 2 checkpoints, names ['MPP']\n")
    code = mpp_command("analyse", "a.ckpt", "b.ckpt", "--names", "a b", "a_b", "--images", "x.tar", "--out", str(tmp_path))
    assert code == 2 and "distinct in file names" in capsys.readouterr().err
    code = mpp_command("analyse", str(tmp_path / "a.ckpt"), "--out", str(tmp_path))
    assert code == 2 and capsys.readouterr().err == (
        f"mpp: error: {tmp_path / 'a.ckpt'} does not exist; give a .ckpt file, e.g. runs/<run>/checkpoints/last.ckpt\n")


def test_the_tool_reads_the_checkpoints_validation_shards_when_no_images_are_given(tmp_path, capsys):
    """A checkpoint of a run names its validation shards (else its test shards); without --images those are
    the images, and a checkpoint naming neither asks for --images."""
    images = noise_shards(tmp_path / "shards")
    path = checkpoint(tmp_path / "mpp.ckpt", TINY, seed=0)
    bare = torch.load(path, map_location="cpu", weights_only=False)
    torch.save({**bare, "datamodule_hyper_parameters": {"val": None, "test": None}}, tmp_path / "bare.ckpt")
    code = mpp_command("analyse", str(tmp_path / "bare.ckpt"), "--out", str(tmp_path / "none"), "--device", "cpu")
    assert code == 2 and capsys.readouterr().err == (
        f"mpp: error: {tmp_path / 'bare.ckpt'} names no validation or test shards: give the images with --images "
        "<shards>\n")
    for split in ("val", "test"):
        torch.save({**bare, "datamodule_hyper_parameters": {split: images}}, tmp_path / f"{split}.ckpt")
        out = tmp_path / split
        code = mpp_command("analyse", str(tmp_path / f"{split}.ckpt"), "--out", str(out), "--num-images", "40",
                           "--map-images", "2", "--device", "cpu")
        assert code == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        # The shards hold 12 images, fewer than asked for: all are read, and said.
        assert printed.startswith(f"images: the first 12 of {images}, the validation shards of {tmp_path / split}.ckpt\n")
        numbers = json.loads((out / "analysis.json").read_text())
        assert numbers["images"] == images and numbers["encoders"][split]["num_images"] == 12


def test_the_callback_analyses_the_encoder_during_a_fit_without_wandb(tmp_path):
    pl.seed_everything(0)
    images = noise_shards(tmp_path / "shards")
    model = MaskedPatchPretraining(encoder=TINY, optimizer=OptimizerConfig(name="adamw", lr=1e-3))
    callback = EncoderAnalysis(images=images, num_images=4, every_n_steps=2, map_images=2, batch_size=4)
    data = ShardDataModule(train=images, batch_size=4, num_workers=0, shuffle_buffer=0)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=pl.loggers.CSVLogger(tmp_path), callbacks=[callback],
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert sorted(callback.history) == [2, 3]  # every 2 steps, and at the end
    assert model.encoder.training
    for step in (2, 3):
        folder = tmp_path / "analyses" / f"step_{step:07d}"
        assert sorted(p.name for p in folder.iterdir()) == [
            "analysis.json", "attention_distance.png", "attention_maps.png", "filters.png", "positions.png"]
        assert json.loads((folder / "analysis.json").read_text()) == callback.history[step]
    # The encoder trained between the two analyses, so they differ.
    assert callback.history[2]["attention_distance"] != callback.history[3]["attention_distance"]
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("analysis/attention_distance/block_1")]
    assert [int(row["step"]) for row in rows] == [2, 3]
    assert float(rows[-1]["analysis/attention_distance/block_1"]) == pytest.approx(
        callback.history[3]["attention_distance"]["per_block"][1])


def test_the_callback_analyses_the_runs_validation_images_unless_given_its_own(tmp_path):
    images, unlabelled = noise_shards(tmp_path / "val"), noise_shards(tmp_path / "train")
    model = MaskedPatchPretraining(encoder=TINY, optimizer=OptimizerConfig(name="adamw", lr=1e-3))
    callback = EncoderAnalysis(num_images=2, map_images=1, batch_size=2)
    data = ShardDataModule(train=unlabelled, val=images, batch_size=2, num_workers=0, shuffle_buffer=0)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[callback], limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert callback.data.specs["val"] == images and sorted(callback.history) == [1]
    with pytest.raises(ValueError, match="the run has no data.val, data.test or data.train: give EncoderAnalysis.images"):
        EncoderAnalysis().setup(pl.Trainer(accelerator="cpu", logger=False), model, "fit")
