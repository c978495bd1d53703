"""The MPP training step of a run config's model in 32-true and bf16-mixed, eager and compiled
(torch.compile, inductor), alternating in one process: which precision and compile pay, per model size.

Every arm is its own copy of the config's model (the same initial weights) trained on one fixed
random uint8 batch: forward + loss under the arm's precision, backward, gradient clipping at the
config's norm and the project's optimiser (mpp.train.optim: fused where the device has it), the
work of one `Trainer.fit` step without Lightning around it. Arms alternate, the order reversing
every round (A B C D D C B A ...). A compiled arm compiles in its first, untimed steps; that time
is printed as well, since every run pays it once for training and once for evaluation.

    python -m benchmarks.bench_precision   # demo: batch 128 of 28 px grey images
    python -m benchmarks.bench_precision --setting vit_b16 --batch 8 --repeats 4 --no-compile
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.kit import (
    alternate,
    argument_parser,
    host_line,
    load_run_config,
    precision_context,
    timed,
    training_step,
)
from mpp import MaskedPatchPretraining
from mpp.model.pixels import pair
from mpp.train.optim import OptimizerConfig, configure_optimizer

Step = Callable[[], None]


def mpp_step(run: dict, *, batch: int, device: torch.device, precision: str, compile: bool) -> Step:
    """One training step of the run config's MaskedPatchPretraining on a fixed random batch."""
    torch.manual_seed(0)
    model = MaskedPatchPretraining(**{**run["model"], "compile": compile}).to(device)
    # `batch` as the global batch: a config with a reference batch scales its lr by it, as a fit does.
    optimizer = configure_optimizer(model, OptimizerConfig(**run["model"]["optimizer"]), 10**6, batch)["optimizer"]
    encoder = model.encoder_config
    height, width = pair(encoder.image_size)
    images = torch.randint(0, 256, (batch, encoder.channels, height, width), dtype=torch.uint8, device=device)
    autocast = precision_context(precision, device)
    clip = run["trainer"].get("gradient_clip_val")
    return functools.partial(training_step, model, optimizer, images, autocast=autocast, clip=clip)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--setting", choices=("demo", "vit_b16"), default="demo")
    parser.add_argument("--batch", type=int, help="images per step (default: the config's data.batch_size)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps of each arm, alternating")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each arm first (compiling ones)")
    parser.add_argument("--no-compile", action="store_true", help="the eager arms only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    run = load_run_config(args.setting)
    batch = args.batch or run["data"]["batch_size"]
    arms = [(precision, compiled) for compiled in (False, True) for precision in ("32-true", "bf16-mixed")]
    steps: dict[str, Step] = {}
    warm: dict[str, float] = {}
    for precision, compiled in arms[: 2 if args.no_compile else 4]:
        name = f"{precision}, {'compiled' if compiled else 'eager'}"
        steps[name] = mpp_step(run, batch=batch, device=device, precision=precision, compile=compiled)
        start = time.perf_counter()
        for _ in range(args.warmup):
            steps[name]()
        warm[name] = time.perf_counter() - start
    seconds = alternate({name: functools.partial(timed, step, device) for name, step in steps.items()}, args.repeats)

    encoder = run["model"]["encoder"]
    print(host_line(str(device)))
    print(
        f"{args.setting}: ViT dim {encoder['dim']} depth {encoder['depth']}, {encoder['image_size']} px x "
        f"{encoder['channels']} ch, batch {batch}; {args.repeats} alternating repeats, median step time\n"
    )
    print("| arm | first steps, s | s/step | img/s | vs 32-true eager |\n|---|---|---|---|---|")
    reference = statistics.median(next(iter(seconds.values())))
    for name, times in seconds.items():
        median = statistics.median(times)
        print(
            f"| {name} | {warm[name]:.1f} ({args.warmup}) | {median:.3f} | {batch / median:.1f} | "
            f"{reference / median:.2f}x |"
        )


if __name__ == "__main__":
    main()
