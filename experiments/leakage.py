"""Does a hybrid's stem leak a [mask]ed token's colour? MPP accuracy per kind of corrupted token, of the
demo ViT, its hybrid, and the hybrid with corruption.mask_pixels, with the transformer blocks frozen
at init and (--trained) with nothing frozen.

    python -m experiments.leakage --results results/leakage
    python -m experiments.leakage --quick --out runs/leakage-quick   # a few steps: the plumbing

Each run is a job of experiments.runner (in runs/<encoder>/<mode>/seed<n> under --out): `mpp fit` of
configs/pretrain/demo.yaml or configs/pretrain/demo_hybrid.yaml for --steps
(frozen: with `--model.init_args.frozen [encoder.blocks]`), then the accuracy of one seeded draw of
corruption of the images (the configs' validation shard, the 1,000 embedded test images: no choice is
made here). The leak is the hybrid's [mask]ed accuracy minus the pure ViT's with the same seed and the
blocks frozen, with a 95% interval over seeds. Runs resume: a finished run is skipped.

A pure ViT's [mask]ed token holds none of its patch's pixels: whatever the model predicts for it
comes from the other tokens. A hybrid's stem sees every pixel, and its receptive field spans more
than one token, so the features of a masked token's neighbours hold part of its colour. With the
transformer blocks frozen at their random init (`MaskedPatchPretraining(frozen=["encoder.blocks"])`),
the blocks cannot learn to infer a colour from the context; what the head predicts for a [mask]ed
token then comes through the embedding (and stem), the blocks' fixed mixing and the final norm. The
hybrid's [mask]ed accuracy above the pure ViT's there is the leak; `corruption.mask_pixels` blanks
the masked tokens' pixels before the stem, and should take it away.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from experiments.jobs import checkpoint_of, run_folder
from experiments.plan import Job
from experiments.report import interval, pct, write_results
from experiments.runner import InOrder, run_study
from experiments.settings import Settings
from experiments.stats import paired, summarise
from mpp.eval.analyses import sized_images
from mpp.model.corruption import KEPT, MASKED, REPLACED
from mpp.model.pixels import to_unit_range
from mpp.train.pretrain import MaskedPatchPretraining

ROOT = Path(__file__).resolve().parents[1]
IMAGES = "shards/fashion-mnist/test-000000.tar"
# name: (pretraining config, overrides)
ENCODERS = {
    "vit": ("configs/pretrain/demo.yaml", []),
    "hybrid": ("configs/pretrain/demo_hybrid.yaml", []),
    "hybrid_mask_pixels": ("configs/pretrain/demo_hybrid.yaml", ["--model.init_args.corruption.mask_pixels", "true"]),
}
LABELS = {"vit": "ViT", "hybrid": "hybrid", "hybrid_mask_pixels": "hybrid, mask_pixels"}
FROZEN = ["--model.init_args.frozen", '["encoder.blocks"]']
QUICK = ("--data.batch_size", "16", "--data.num_workers", "0", "--trainer.limit_val_batches", "2")


KINDS = {"masked": MASKED, "replaced": REPLACED, "kept": KEPT}


@torch.no_grad()
def accuracy_by_kind(module: Any, images: Tensor, *, seed: int = 0, batch_size: int = 250) -> dict[str, Any]:
    """MPP accuracy of a `MaskedPatchPretraining` on (N, C, H, W) images, per kind of corrupted token.

    One draw of corruption per image from a generator seeded by `seed`, so that modules scored with the
    same seed see the same corrupted tokens. Returns, for each of `masked`, `replaced`, `kept` and `all`,
    the share of right predictions and the number of tokens, and `majority`: the share of [mask]ed
    tokens whose target is the most common target among them (always guessing that class).
    """
    if module.target.kind == "pixels":
        raise ValueError("accuracy_by_kind needs class targets; target.kind is pixels")
    was_training = module.training
    module.eval()
    right = dict.fromkeys([*KINDS, "all"], 0)
    total = dict.fromkeys([*KINDS, "all"], 0)
    masked_targets = []
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for chunk in images.split(batch_size):
            output = module(to_unit_range(chunk))
            hits = output.predictions.argmax(dim=-1) == output.targets
            kinds = output.corrupted.kinds
            if hits.dim() > kinds.dim():  # several predictions per token (downsized colours)
                kinds = kinds.unsqueeze(-1).expand_as(hits)
            for name, kind in KINDS.items():
                chosen = kinds == kind
                right[name] += int(hits[chosen].sum())
                total[name] += int(chosen.sum())
            right["all"] += int(hits.sum())
            total["all"] += hits.numel()
            masked_targets.append(output.targets[kinds == MASKED])
    finally:
        torch.random.set_rng_state(state)
        module.train(was_training)
    targets = torch.cat(masked_targets)
    majority = float(torch.bincount(targets).max() / len(targets)) if len(targets) else float("nan")
    scores: dict[str, Any] = {
        name: {"accuracy": right[name] / total[name] if total[name] else float("nan"), "tokens": total[name]}
        for name in total
    }
    scores["majority"] = majority
    return scores


def run_name(encoder: str, mode: str, seed: int) -> str:
    return f"{encoder}/{mode}/seed{seed}"


def fit_job(encoder: str, mode: str, seed: int, args: argparse.Namespace) -> Job:
    """The pretraining run of an encoder, its blocks frozen or not, with a seed: a job of experiments.runner,
    resumed from its last checkpoint, checkpointed every third of its steps."""
    config, overrides = ENCODERS[encoder]
    fit = [*overrides, *(FROZEN if mode == "frozen" else []),
           "--seed_everything", str(seed), "--data.seed", str(seed), "--trainer.max_steps", str(args.steps),
           "--trainer.val_check_interval", str(args.steps), *(QUICK if args.quick else [])]  # fmt: skip
    return Job(run_name(encoder, mode, seed), "fit", config, tuple(fit))


def scored(out: Path, encoder: str, mode: str, seed: int, args: argparse.Namespace, fitted: dict) -> dict[str, Any]:
    """A fitted run's MPP accuracy per kind of token, kept in its folder (scores.json) for the same images."""
    folder = run_folder(out, run_name(encoder, mode, seed))
    what = {"encoder": encoder, "mode": mode, "seed": seed, "steps": args.steps, "images": args.images,
            "count": args.count}  # fmt: skip
    path = folder / "scores.json"
    if path.exists() and {key: value for key, value in json.loads(path.read_text()).items() if key in what} == what:
        return json.loads(path.read_text())
    start = time.perf_counter()
    module = MaskedPatchPretraining.load_from_checkpoint(checkpoint_of(out, run_name(encoder, mode, seed)),
                                                         map_location="cpu", weights_only=False)  # fmt: skip
    images = sized_images(args.images, module.encoder_config, args.count)
    result = {**what, "scores": accuracy_by_kind(module.float(), images, seed=seed),
              "wall_seconds": fitted["wall_seconds"] + time.perf_counter() - start}  # fmt: skip
    path.write_text(json.dumps(result, indent=1))
    return result


def summary(results: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Mean ± std per encoder, mode and kind of token, and the leaks with their paired intervals."""

    def accuracies(encoder: str, mode: str, kind: str) -> dict[int, float]:
        return {
            r["seed"]: r["scores"][kind]["accuracy"] for r in results if (r["encoder"], r["mode"]) == (encoder, mode)
        }

    rows = []
    for mode in modes:
        for encoder in ENCODERS:
            row: dict[str, Any] = {"encoder": encoder, "mode": mode}
            for kind in [*KINDS, "all"]:
                row[kind] = summarise(list(accuracies(encoder, mode, kind).values())).as_dict()
            majority = {
                r["seed"]: r["scores"]["majority"] for r in results if (r["encoder"], r["mode"]) == (encoder, mode)
            }
            row["majority"] = summarise(list(majority.values())).as_dict()
            rows.append(row)
    leaks = {f"{encoder} - vit, {mode}": paired(accuracies(encoder, mode, "masked"),
                                                 accuracies("vit", mode, "masked")).as_dict()
             for mode in modes for encoder in ENCODERS if encoder != "vit"}  # fmt: skip
    return {"rows": rows, "leaks": leaks}


def render(study: dict[str, Any]) -> str:
    lines = [f"`{study['command']}`: {study['steps']} steps each, seeds {study['seeds']}, MPP accuracy (%) of one "
             f"seeded draw of corruption of {study['count']} images of `{study['images']}`, mean ± std over seeds.",
             "", "| encoder | blocks | [mask]ed | replaced | kept | all corrupted | [mask]ed majority class |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in study["summary"]["rows"]:
        cells = [pct(row[kind]) for kind in (*KINDS, "all", "majority")]
        lines.append(f"| {LABELS[row['encoder']]} | {row['mode']} | " + " | ".join(cells) + " |")
    lines += ["", "[mask]ed accuracy against the pure ViT's, same seeds (paired; 95% interval over seeds):", ""]
    lines += [f"- {name}: {interval(value)}" for name, value in study["summary"]["leaks"].items()]
    wall = sum(r["wall_seconds"] for r in study["runs"])
    lines += ["", f"Wall time of the {len(study['runs'])} runs: {wall / 60:.1f} min."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="pretraining steps per run (default 300; --quick 4)")
    parser.add_argument("--seeds", type=int, help="seeds per encoder and mode (default 2; --quick 1)")
    parser.add_argument("--trained", action=argparse.BooleanOptionalAction, default=True,
                        help="also the runs with nothing frozen (default: on)")  # fmt: skip
    parser.add_argument("--images", default=IMAGES, help="shards whose images are scored")
    parser.add_argument("--count", type=int, help="images scored (default 1000; --quick 64)")
    parser.add_argument("--quick", action="store_true", help="a few steps, small batches: checks the plumbing")
    parser.add_argument("--out", default="runs/leakage", help="folder of the runs")
    parser.add_argument("--results", help="also write leakage.md and leakage.json to this folder")
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 300)
    args.count = args.count or (64 if args.quick else 1000)
    seeds = list(range(args.seeds or (1 if args.quick else 2)))
    modes = ["frozen", "trained"] if args.trained else ["frozen"]
    out = Path(args.out).absolute()
    results_folder = Path(args.results).absolute() if args.results else None
    command = "python -m experiments.leakage " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    os.chdir(ROOT)  # the configs and the embedded shards are named relative to the project
    torch.set_num_threads(os.cpu_count() or 1)
    keys = [(encoder, mode, seed) for mode in modes for encoder in ENCODERS for seed in seeds]
    jobs = [fit_job(*key, args) for key in keys]
    settings = Settings.of_runs({}, checkpoint_every=max(1, args.steps // 3))
    fitted = run_study(settings, out, jobs=1, plan=InOrder(jobs))
    runs = [scored(out, *key, args, fitted[job.name]) for key, job in zip(keys, jobs)]
    study = {"command": command.strip(), "steps": args.steps, "seeds": seeds, "images": args.images,
             "count": args.count, "runs": runs, "summary": summary(runs, modes)}  # fmt: skip
    table = render(study)
    write_results([out] + ([results_folder] if results_folder else []), "leakage", study, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
