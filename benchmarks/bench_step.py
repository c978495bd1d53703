"""Training-step throughput of the ViT-B/16 MPP step next to timm's `vit_base_patch16_224`
classification step, in the same process, alternating, at the same batch size.

Both steps are forward + backward + AdamW update on random data (uint8 images for MPP, as
the data module yields them; float images and labels for timm), in float32 or under bf16
autocast (`--precision bf16-mixed`, as Lightning's bf16-mixed runs a step), eager or compiled
(`--compile mpp`: the MPP module compiles itself as the ViT-B/16 config's `compile: true`
does; `--compile both`: timm's model too, with torch.compile's defaults). timm is a
benchmark-only dependency: `make bench` installs it in its own environment.

    python -m benchmarks.bench_step --batch 8 --repeats 5
    python -m benchmarks.bench_step --batch 8 --repeats 5 --precision bf16-mixed
    python -m benchmarks.bench_step --batch 8 --repeats 5 --compile both
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from benchmarks.kit import alternate, argument_parser, host_line, precision_context, timed, training_step
from mpp import MaskedPatchPretraining, OptimizerConfig, ViTConfig

PRESET = Path(__file__).parents[1] / "configs" / "model" / "vit_b.yaml"


def mpp_step(batch: int, image_size: int, device: torch.device, *, precision: str, compile: bool) -> Callable[[], None]:
    """One MPP training step of ViT-B/16 on a fixed random batch."""
    config = ViTConfig(**yaml.safe_load(PRESET.read_text()), image_size=image_size, patch_size=16)
    optimizer_config = OptimizerConfig(name="adamw", lr=1e-4)
    model = MaskedPatchPretraining(encoder=config, optimizer=optimizer_config, compile=compile).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randint(0, 256, (batch, 3, image_size, image_size), dtype=torch.uint8, device=device)
    return functools.partial(training_step, model, optimizer, images, autocast=precision_context(precision, device))


def timm_step(
    batch: int, image_size: int, device: torch.device, *, precision: str, compile: bool
) -> Callable[[], None]:
    """One classification training step of timm's ViT-B/16 on a fixed random batch."""
    import timm

    model = timm.create_model("vit_base_patch16_224", img_size=image_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.rand(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    forward = torch.compile(model) if compile else model
    autocast = precision_context(precision, device)

    def step() -> None:
        with autocast():
            loss = torch.nn.functional.cross_entropy(forward(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each, alternating")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each first")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument(
        "--compile", choices=("none", "mpp", "both"), default="none", help="which steps' models torch.compile"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    steps = {
        "mpp ViT-B/16 (MPP step)": mpp_step(
            args.batch, args.image_size, device, precision=args.precision, compile=args.compile != "none"
        ),
        "timm vit_base_patch16_224 (classification step)": timm_step(
            args.batch, args.image_size, device, precision=args.precision, compile=args.compile == "both"
        ),
    }
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    # Alternate, and swap who goes first every repeat (ABBA), so that machine noise and
    # whatever one step leaves behind for the next hit both alike.
    seconds = alternate({name: functools.partial(timed, step, device) for name, step in steps.items()}, args.repeats)

    print(host_line(str(device)))
    compiled = {"none": "eager", "mpp": "mpp compiled, timm eager", "both": "both compiled"}[args.compile]
    print(
        f"batch {args.batch}, {args.image_size} px, {args.precision}, {compiled}, {args.repeats} alternating "
        f"repeats, median step time\n"
    )
    print("| step | s/step | img/s |\n|---|---|---|")
    rates = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        rates[name] = args.batch / median
        print(f"| {name} | {median:.3f} | {rates[name]:.2f} |")
    mine, theirs = rates.values()
    print(f"\nratio mpp / timm: {mine / theirs:.3f}x")


if __name__ == "__main__":
    main()
