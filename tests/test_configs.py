"""Every shipped run config, as a user runs it: `mpp fit --config configs/trainer/cpu.yaml --config
<run config>` for 2 steps, changed only by overrides that shrink it (batch, samples per epoch,
workers, compile off, and ViT-B/16's images in the default run); fine-tuning starts from the
checkpoint its pretraining run left where the config looks for it. The GPU trainer presets with each
run config print their config and instantiate (with CUDA mocked: nothing runs on a device here). The
first log lines must show the global batch and peak learning rate the config asks for, and the
optimiser must use that rate.

The fits run as on a CPU without bf16 (oneDNN and ATen held to AVX2, which mpp.precision reads), on
every machine: each config's no-bf16 path, the one most laptops take, is the one fitted here; each
config's precision on both kinds of CPU and GPU is checked by instantiating it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import statistics
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from probes import records
from workspace import NO_BF16, ROOT, console_script, environment, fewshot_on_fewer_images, make_workspace, run

from mpp.config import read_config

# Pretraining first: the fine-tuning configs read its checkpoints.
RUN_CONFIGS = [f"{arm}/{recipe}.yaml" for arm in ("pretrain", "scratch", "finetune")
               for recipe in ("demo", "vit_b16", "demo_hybrid", "vit_b16_r50")]
# R50+ViT-B/16 takes about a minute a 2-step fit here (its stem at 224 and 384 px): `make test-slow`.
SLOW_RECIPES = {"vit_b16_r50"}


def run_config(name: str) -> str | pytest.param:
    """`name` as a test parameter, marked slow where its recipe is."""
    return pytest.param(name, marks=pytest.mark.slow) if Path(name).stem in SLOW_RECIPES else name


RUN_PARAMS = [run_config(name) for name in RUN_CONFIGS]
PRESETS = ["gpu", "ddp", "fsdp"]  # configs/trainer/gpu.yaml, configs/trainer/ddp.yaml, configs/trainer/fsdp.yaml
# The size preset each run config names (`encoder: {__base__: ../model/<preset>, ...}`).
PRESET_OF = {name: "configs/model/" + {"demo": "vit_demo.yaml", "vit_b16": "vit_b.yaml", "demo_hybrid": "vit_demo_hybrid.yaml",
                                        "vit_b16_r50": "vit_b_r50.yaml"}[Path(name).stem]
             for name in RUN_CONFIGS}
# Size presets; ViT-L and ViT-H (303M and 631M parameters) take minutes a step here: `make test-slow`.
# (vit_demo.yaml and vit_b.yaml are the demo's and the ViT-B/16 recipes' own, fitted with them above.)
MODEL_PRESETS = ["configs/model/vit_ti.yaml", "configs/model/vit_s.yaml",
                 pytest.param("configs/model/vit_l.yaml", marks=pytest.mark.slow),
                 pytest.param("configs/model/vit_h.yaml", marks=pytest.mark.slow)]
BATCH = 2
# ViT-B/16 at its recipes' 224 and 384 px takes minutes a fit on a CPU without bf16: the default run fits
# it on images of 4 x 4 and (fine-tuning) 7 x 7 of its 16 px patches; `make test-slow` at full size.
SMALL_IMAGES = {"vit_b16": {"pretrain": 64, "scratch": 64, "finetune": 112}}


def config_of(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def printed_config(*args: str) -> dict:
    """`mpp fit <args> --print_config`, in this process and folder: the resolved config."""
    from mpp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["fit", *args, "--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


def image_size(name: str, *, full: bool = False) -> int:
    """The encoder's image size a fit of run config `name` takes here."""
    arm, recipe = name.removesuffix(".yaml").split("/")
    small = SMALL_IMAGES.get(recipe, {}).get(arm)
    return small if small and not full else config_of(name)["model"]["init_args"]["encoder"]["image_size"]


def shrink(name: str, *, full: bool = False) -> list[str]:
    """Overrides that make a run config a 2-step run here; nothing else changes."""
    args = ["--data.batch_size", str(BATCH), "--data.num_workers", "0", "--trainer.max_steps", "2",
            "--model.init_args.compile", "false", "--trainer.limit_val_batches", "2",
            "--trainer.enable_progress_bar", "false"]
    if config_of(name)["data"].get("resampled"):
        args += ["--data.samples_per_epoch", str(4 * BATCH)]
    if image_size(name, full=full) != image_size(name, full=True):
        args += ["--model.init_args.encoder.image_size", str(image_size(name))]
    return args + fewshot_on_fewer_images(["mpp", "fit", "--config", f"configs/{name}"], ROOT)


def expected_batch_and_lr(name: str, *, batch: int = BATCH, devices: int = 1) -> tuple[int, float]:
    """The global batch and peak lr the config's own numbers give with `batch` on each of `devices`."""
    config = config_of(name)
    total = devices * batch * config["trainer"].get("accumulate_grad_batches", 1)
    optimizer = config["model"]["init_args"]["optimizer"]
    reference = optimizer.get("reference_batch_size")
    factor = 1.0 if reference is None else total / reference
    if optimizer.get("lr_scaling") == "sqrt":
        factor = math.sqrt(factor)
    return total, optimizer["lr"] * factor


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_every_run_config_takes_its_encoder_size_from_the_preset_it_names(name: str, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """The preset's numbers are written once, in configs/model/: a run config names the file, relative
    to itself, so it resolves from a user's own folder with a copy of the configs, and a value on the
    command line still wins over the preset."""
    written = config_of(name)["model"]["init_args"]["encoder"]
    preset = read_config(ROOT / PRESET_OF[name])  # a hybrid's preset is its ViT's with a stem
    assert written["__base__"] == "../model/" + Path(PRESET_OF[name]).name and not preset.keys() & written.keys()
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    args = ["--config", "configs/trainer/cpu.yaml", "--config", f"configs/{name}"]
    encoder = printed_config(*args)["model"]["init_args"]["encoder"]
    own = {key: value for key, value in written.items() if key != "__base__"}
    assert {key: encoder[key] for key in [*preset, *own]} == {**preset, **own}
    overridden = printed_config(*args, "--model.init_args.encoder.depth", "2")["model"]["init_args"]["encoder"]
    assert overridden == {**encoder, "depth": 2}
    larger = printed_config(*args, "--model.init_args.encoder", "configs/model/vit_l.yaml")["model"]["init_args"]
    assert larger["encoder"] == {**encoder, **yaml.safe_load((ROOT / "configs/model/vit_l.yaml").read_text())}


class Fits(dict):
    """Each run config fitted 2 steps in one workspace, when a test first asks for it; a fine-tuning config's
    pretraining run first, since the fine-tuning config reads its checkpoint. `full`: at the recipe's own
    image size."""

    def __init__(self, folder: Path, *, full: bool = False) -> None:
        super().__init__()
        self.folder, self.full = folder, full

    def __missing__(self, name: str) -> dict:
        if name.startswith("finetune/"):
            self[name.replace("finetune/", "pretrain/", 1)]
        tag = name.replace("/", "-").removesuffix(".yaml")
        probe = json.dumps({"class_path": "probes.RunProbe",
                            "init_args": {"out": str(self.folder / "probe"), "tag": tag}})
        result, seconds = run([console_script("mpp"), "fit", "--config", "configs/trainer/cpu.yaml", "--config",
                               f"configs/{name}", *shrink(name, full=self.full), f"--trainer.callbacks+={probe}"],
                              self.folder, env=environment(**NO_BF16))
        probe_records = records(self.folder / "probe" / f"{tag}-rank0.jsonl") if result.returncode == 0 else []
        self[name] = {"result": result, "seconds": seconds, "records": probe_records, "folder": self.folder}
        return self[name]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Fits:
    return Fits(make_workspace(tmp_path_factory.mktemp("user")))


@pytest.fixture(scope="module")
def full_fits(tmp_path_factory: pytest.TempPathFactory) -> Fits:
    return Fits(make_workspace(tmp_path_factory.mktemp("user-full")), full=True)


@pytest.mark.parametrize("name", RUN_PARAMS)
def test_every_run_config_fits_two_steps_on_the_cpu_preset(fits: Fits, name: str) -> None:
    check_fit(fits[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RUN_CONFIGS if Path(name).stem in SMALL_IMAGES])
def test_the_recipes_fit_two_steps_at_their_own_image_size(full_fits: Fits, name: str) -> None:
    check_fit(full_fits[name], name)
    assert f"of {image_size(name, full=True)} px images" in full_fits[name]["result"].stdout


def check_fit(fit: dict, name: str) -> None:
    """A 2-step fit of run config `name` ran, said what it ran, and left its checkpoint."""
    assert fit["result"].returncode == 0, fit["result"].stderr[-4000:]
    out = fit["result"].stdout + fit["result"].stderr
    total, peak = expected_batch_and_lr(name)
    accumulate = config_of(name)["trainer"].get("accumulate_grad_batches", 1)
    match = re.search(r"mpp: global batch (\d+) = 1 node\(s\) x 1 device\(s\) x batch (\d+) x (\d+) accumulated; "
                      r"peak lr ([0-9.e+-]+)", out)
    assert match, out[:3000]
    assert (int(match[1]), int(match[2]), int(match[3])) == (total, BATCH, accumulate)
    assert float(match[4]) == pytest.approx(peak, rel=1e-3)
    # A CPU without bf16 runs float32, whether the config names bf16 (the recipes) or nothing (the demos).
    named = config_of(name)["trainer"].get("precision")
    why = f"{named} asked for, but the CPU has no bf16 instructions" if named else "trainer.precision unset: the CPU has no bf16"
    assert f"precision 32-true ({why}" in out, out[:3000]
    start, *steps = [r for r in fit["records"] if r["event"] in ("start", "step")]
    assert start["initial_lr"] == pytest.approx([peak, peak]), "the optimiser's peak lr is not the printed one"
    assert len(steps) == 2 * accumulate
    root = Path(fit["folder"]) / config_of(name)["trainer"]["default_root_dir"]
    saved = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2
    times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    print(f"{name}: {fit['seconds']:.0f} s in all, median {statistics.median(times):.2f} s per batch of {BATCH}")


@pytest.mark.parametrize("recipe", ["vit_b16", pytest.param("vit_b16_r50", marks=pytest.mark.slow)])
def test_a_finetune_config_starts_from_its_pretraining_run(fits: Fits, recipe: str) -> None:
    """configs/finetune/vit_b16.yaml fine-tunes at 384 px the 224 px encoder of the pretraining run (here at
    112 and 64 px: 7 x 7 and 4 x 4 patches); the hybrid's positions are interpolated on its stem's stride-16
    feature grid."""
    folder = fits[f"finetune/{recipe}.yaml"]["folder"]
    pretrained = torch.load(folder / f"runs/{recipe}_mpp/checkpoints/last.ckpt", map_location="cpu",
                            weights_only=True)
    finetuned = torch.load(folder / f"runs/{recipe}_finetune/checkpoints/last.ckpt", map_location="cpu",
                           weights_only=True)
    sizes = image_size(f"pretrain/{recipe}.yaml"), image_size(f"finetune/{recipe}.yaml")
    assert sizes[0] < sizes[1]
    assert (pretrained["encoder_config"]["image_size"], finetuned["encoder_config"]["image_size"]) == sizes
    key = "encoder.pos_embed"
    assert pretrained["state_dict"][key].shape[1] == 1 + (sizes[0] // 16) ** 2
    assert finetuned["state_dict"][key].shape[1] == 1 + (sizes[1] // 16) ** 2


def test_an_evaluation_says_when_it_runs_another_precision_than_its_configs(fits: Fits) -> None:
    """`mpp test` of the fine-tuned ViT-B/16 recipe (bf16-mixed) on a CPU without bf16: one line says so."""
    name = "finetune/vit_b16.yaml"
    folder = fits[name]["folder"]
    result, _ = run([console_script("mpp"), "test", "--config", "configs/trainer/cpu.yaml", "--config",
                     f"configs/{name}", *shrink(name), "--trainer.limit_test_batches", "2", "--trainer.logger", "false",
                     "--ckpt_path", "runs/vit_b16_finetune/checkpoints/last.ckpt"], folder, env=environment(**NO_BF16))
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("mpp: precision 32-true (bf16-mixed asked for, but the CPU has no bf16 instructions (AVX-512 BF16 or AMX) "
            "and would emulate it an order of magnitude slower than float32)") in result.stdout + result.stderr
    assert "test/accuracy" in result.stdout


def instantiate(*args: str, bf16: bool = True) -> object:
    """The CLI's model, data and trainer for `args`, built as on a machine with 8 GPUs (with bf16, or
    without as a V100's), without running."""
    import lightning_fabric.accelerators.cuda as fabric_cuda
    import pytorch_lightning as pl
    from pytorch_lightning.accelerators.cuda import CUDAAccelerator

    from mpp.cli import MPPCLI
    from mpp.data.module import ShardDataModule

    with (mock.patch.object(fabric_cuda, "num_cuda_devices", return_value=8),
          mock.patch.object(CUDAAccelerator, "is_available", return_value=True),
          mock.patch("torch.cuda.is_available", return_value=True),
          mock.patch("torch.cuda.device_count", return_value=8),
          mock.patch("torch.cuda.is_bf16_supported", return_value=bf16)):
        return MPPCLI(pl.LightningModule, ShardDataModule, subclass_mode_model=True, run=False,
                      auto_configure_optimizers=False, args=list(args))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", [run_config(name) if name.startswith("finetune/") else name for name in RUN_CONFIGS])
def test_every_gpu_preset_with_every_run_config_prints_and_instantiates(fits: dict[str, dict], name: str,
                                                                       preset: str, monkeypatch) -> None:
    from mpp.summary import run_summary
    from mpp.train.strategies import BlockFSDPStrategy

    # A fine-tuning config instantiates from its pretraining run's checkpoint: that run is fitted first.
    monkeypatch.chdir(fits[name.replace("finetune/", "pretrain/", 1)]["folder"] if name.startswith("finetune/")
                      else fits.folder)
    args = ["--config", f"configs/trainer/{preset}.yaml", "--config", f"configs/{name}"]
    resolved = printed_config(*args)
    assert resolved["trainer"]["accelerator"] == "gpu", "the run config must leave the hardware to the preset"

    cli = instantiate(*args, "--trainer.logger", "false")
    trainer = cli.trainer
    devices = 1 if preset == "gpu" else 8
    assert trainer.num_devices == devices
    strategy = {"gpu": "SingleDeviceStrategy", "ddp": "DDPStrategy", "fsdp": "BlockFSDPStrategy"}[preset]
    assert type(trainer.strategy).__name__ == strategy
    if preset == "ddp":
        assert trainer.strategy._timeout == timedelta(minutes=30)
    if preset == "fsdp":
        assert isinstance(trainer.strategy, BlockFSDPStrategy)
    precision = config_of(name)["trainer"].get("precision") or "bf16-mixed"
    assert trainer.precision == precision
    total, peak = expected_batch_and_lr(name, batch=config_of(name)["data"]["batch_size"], devices=devices)
    summary = run_summary(trainer, cli.model, cli.datamodule)
    assert f"global batch {total} = 1 node(s) x {devices} device(s)" in summary
    assert float(re.search(r"peak lr ([0-9.e+-]+)", summary)[1]) == pytest.approx(peak, rel=1e-3)


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_every_size_preset_fits_a_step_in_the_vit_b16_recipe(tmp_path: Path, preset: str) -> None:
    """`--model.encoder <preset>` as the README writes it, at 32 px so one step is quick."""
    folder = make_workspace(tmp_path / "user")
    result, _ = run([console_script("mpp"), "fit", "--config", "configs/trainer/cpu.yaml", "--config",
                     "configs/pretrain/vit_b16.yaml", "--model.encoder", preset, *shrink("pretrain/vit_b16.yaml"),
                     "--model.init_args.encoder.image_size", "32", "--trainer.max_steps", "1"], folder)
    assert result.returncode == 0, result.stderr[-4000:]
    size = yaml.safe_load((ROOT / preset).read_text())
    shown = f"encoder {size['dim']}x{size['depth']} ({size['heads']} heads), 16 px patches of 32 px images"
    assert shown in result.stdout


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "no-bf16"])
@pytest.mark.parametrize("preset", ["cpu", "gpu"])
@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_every_run_config_takes_bf16_only_where_the_device_computes_it(name: str, preset: str, bf16: bool,
                                                                     monkeypatch) -> None:
    """With the device's bf16 faked either way: a run config's bf16 (the recipes', the GPU preset's) or none
    (the demos' on the CPU preset) gives bf16-mixed where the CPU or GPU computes bf16, and 32-true with the
    reason where it would emulate it. (A 1-block encoder from a random init: only the trainer matters.)"""
    from mpp import precision

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: bf16)
    named = config_of(name)["trainer"].get("precision") or yaml.safe_load(
        (ROOT / "configs" / "trainer" / f"{preset}.yaml").read_text())["trainer"].get("precision")
    cli = instantiate("--config", f"configs/trainer/{preset}.yaml", "--config", f"configs/{name}",
                      "--trainer.logger", "false", "--model.init_args.encoder.depth", "1",
                      *(["--model.init_args.pretrained", "null"] if name.startswith("finetune/") else []), bf16=bf16)
    device = {"cpu": "the CPU has", "gpu": "the GPU has"}[preset]
    if bf16:
        assert cli.trainer.precision == named or (named is None and cli.trainer.precision == "bf16-mixed")
        assert cli.precision_note == ("" if named else " (trainer.precision unset: the CPU has bf16 instructions)")
    elif named:
        assert cli.trainer.precision == "32-true"
        assert cli.precision_note.startswith(f" ({named} asked for, but {device} no bf16")
        assert cli.precision_note.endswith(" and would emulate it an order of magnitude slower than float32)")
    else:
        assert cli.trainer.precision == "32-true"
        assert cli.precision_note == " (trainer.precision unset: the CPU has no bf16 instructions)"
