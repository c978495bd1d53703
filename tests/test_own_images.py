"""docs/own-images.md as a user runs it: their own colour images of another size, in 3 class folders,
to shards, pretraining, fine-tuning, the per-class test accuracy, the encoder's embeddings read by
numpy and its export, with the demo's configs and the configs/data/own.yaml overlay. The folder holds no FashionMNIST shards, so a run that read them would
fail; the few-shot evaluation and the analyses run on the user's shards, the classes come from their
index.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_readme import code_blocks
from workspace import ROOT, console_script, environment, run

from mpp.commands import COMMANDS as MPP_COMMANDS
from mpp.outputs.wandb_records import history

DOC = (ROOT / "docs" / "own-images.md").read_text()
COMMANDS = [shlex.split(line) for block in code_blocks(DOC) for line in block]
CLASSES = ["circle", "square", "triangle"]
SHRINK = [
    "--trainer.max_steps",
    "3",
    "--data.batch_size",
    "8",
    "--data.samples_per_epoch",
    "24",
    "--data.num_workers",
    "0",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's folder: the project's configs, and 40 colour images of 36 x 30 px per class in ~/shapes."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "configs").symlink_to(ROOT / "configs")
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        (folder / "shapes" / name).mkdir(parents=True)
        for index in range(40):
            pixels = rng.integers(0, 80, (30, 36, 3), dtype=np.uint8)
            pixels[..., label] += 150  # each class its own colour
            Image.fromarray(pixels).save(folder / "shapes" / name / f"{index}.png")
    return folder


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:4]))
def test_own_images_from_a_folder_to_the_per_class_test_accuracy(user: Path, command: list[str]) -> None:
    env = environment(HOME=str(user))
    if command[1] in MPP_COMMANDS:  # shards, export: no run to shrink
        argv = [arg.replace("~", str(user)) for arg in command]
        extra = ["--no-progress"] if command[1] == "shards" else []
        result, _ = run([console_script("mpp"), *argv[1:], *extra], user, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        if command[1] == "export":
            assert sorted(p.name for p in (user / command[-1]).iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
        return
    result, _ = run([console_script("mpp"), *command[1:], *SHRINK], user, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "fashion-mnist" not in out
    root = user / command[command.index("--trainer.default_root_dir") + 1]
    if command[1] == "fit" and "pretrain" in str(root):  # the evaluations ran on the user's shards
        assert list((root / "analyses").glob("step_*/attention_maps.png"))
        (run_folder,) = (root / "wandb").glob("offline-run-*")
        scores = [row["fewshot/knn"] for row in history(run_folder) if "fewshot/knn" in row]
        assert len(scores) == 2 and all(0 <= score <= 1 for score in scores), scores  # at the start and the end
    if command[1] == "fit" and "finetune" in str(root):
        assert "mpp: 3 classes from shards/shapes/train.json: circle, square, triangle" in out
    if command[1] == "test":
        shown = re.findall(r"test/accuracy/([^│┃]+?)\s*│", out)
        assert sorted(shown) == CLASSES, out[-3000:]
    if command[1] == "predict":  # the held-out fifth of 120 images
        assert f"mpp: predictions of 24 samples in {command[command.index('--predictions.out') + 1]}" in out


def test_the_numpy_lines_read_the_predictions(user: Path) -> None:
    """The page's python block, run as written after its commands: the keys and the embeddings, a row each."""
    (block,) = re.findall(r"^```python\n(.*?)^```", DOC, flags=re.S | re.M)
    result, _ = run([sys.executable, "-c", block], user, env=environment(HOME=str(user)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.fullmatch(r"24 \(24, 128\) (32-true|bf16-mixed)\n", result.stdout), result.stdout
    keys = (user / "runs/shapes/embeddings/keys.txt").read_text().splitlines()
    assert len(set(keys)) == 24, keys  # each image once
