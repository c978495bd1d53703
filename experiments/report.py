"""What came out of a study: the audit of its test-set reads, its numbers as one JSON-able mapping
(`summarise_study`), and the markdown table and plots made from them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.jobs import read_results, test_reads  # noqa: E402
from experiments.plan import Job, Plan, kind_of, pretrain_name  # noqa: E402
from experiments.settings import ARMS, DEFAULT_VARIANT, PAIRS, PRETRAINED, VARIANTS, Settings  # noqa: E402
from experiments.stats import paired, summarise  # noqa: E402
from experiments.timing import elapsed  # noqa: E402

# How the table names each arm's frozen pretrained encoder.
FROZEN_LABELS = {"mpp": "MPP", "supervised": "supervised", "hybrid_mpp": "hybrid MPP"}


def audit_test_reads(
    plan: Plan, choices: dict[str, dict[str, Any]], reads: list[dict[str, Any]], joined: dict[str, float] | None = None
) -> dict[str, Any]:
    """Whether the test set was read only by the evaluations of final runs and pretrained encoders, each
    once, and only after the last choice was made, of the arms the study had then (`joined`: when each
    arm joined the study, arms.json; None: all with its first settings)."""
    allowed = {job.name for job in plan.evaluations(choices)}
    joined = joined or dict.fromkeys(plan.s.selected_arms, 0.0)
    counts: dict[str, int] = {}
    for read in reads:
        counts[read["job"]] = counts.get(read["job"], 0) + 1
    problems = [f"{name} read the test set but is no final evaluation" for name in counts if name not in allowed]
    for read in reads:
        then = [
            choice["time"] for key, choice in choices.items() if joined.get(key.split("/", 1)[1], 0.0) <= read["time"]
        ]
        if read["time"] < max(then, default=0.0):
            problems.append(f"{read['job']} read the test set before the last choice")
    problems += [f"{name} never read the test set" for name in sorted(allowed - set(counts))]
    first = min(joined.values(), default=0.0)
    return {
        "reads": len(reads),
        "evaluations": len(allowed),
        "read_more_than_once": sorted(name for name, n in counts.items() if n > 1),
        "arms_added_later": sorted(arm for arm, time_ in joined.items() if time_ > first),
        "problems": problems,
    }


def _scores(results: dict[str, dict], names: dict[int, str], shots: Sequence[int]) -> dict[str, Any]:
    """Frozen scores of runs {seed: job name}, summarised over seeds."""
    frozen = {seed: results[name]["frozen"] for seed, name in names.items()}
    scores = {f"{n}-shot": summarise([f["fewshot"][str(n)] for f in frozen.values()]).as_dict() for n in shots}
    scores["k-NN"] = summarise([f["knn"] for f in frozen.values()]).as_dict()
    scores["linear probe"] = summarise([f["linear"] for f in frozen.values()]).as_dict()
    return scores


def summarise_study(settings: Settings, out: Path) -> dict[str, Any]:
    """Everything the study measured, as one JSON-able mapping."""
    plan, results = Plan(settings), read_results(out)
    choices = json.loads((out / "choices.json").read_text())
    joined = json.loads((out / "arms.json").read_text()) if (out / "arms.json").exists() else None
    seeds, pre = settings.seeds, settings.pretrain_steps
    budgets: dict[str, Any] = {}
    for budget in settings.budgets:
        arms: dict[str, Any] = {}
        for arm in settings.arms(budget):
            choice = choices[f"b{budget}/{arm}"]
            finals = dict(zip(seeds, plan.finals(budget, arm, choice["lr"])))
            test = {seed: results[job.name + "/test"]["test_accuracy"] for seed, job in finals.items()}
            offset = pre if arm in PRETRAINED else 0  # curves against all optimiser steps
            arms[arm] = {
                "label": ARMS[arm],
                "lr": choice["lr"],
                "val_accuracy_by_lr": choice["val_accuracy"],
                "test_accuracy": summarise(list(test.values())).as_dict(),
                "test_accuracy_by_seed": {str(s): v for s, v in test.items()},
                "frozen": _scores(results, {s: job.name + "/test" for s, job in finals.items()}, settings.shots),
                "pretrain_steps": offset,
                "steps": results[finals[seeds[0]].name]["val_curve"][-1][0],
                "val_curves": {
                    str(s): [(step + offset, v) for step, v in results[job.name]["val_curve"]]
                    for s, job in finals.items()
                },
                "wall_seconds": sum(results[job.name]["wall_seconds"] for job in finals.values()) / len(finals),
            }
        by_seed = {arm: {int(s): v for s, v in arms[arm]["test_accuracy_by_seed"].items()} for arm in arms}
        pairs = [(a, b) for a, b in PAIRS if a in arms and b in arms]
        pretrained = {arm: {seed: f"frozen/b{budget}/{name}" for seed, name in zip(seeds, names)}
                      for arm, names in plan.pretrained_sources(budget).items()}  # fmt: skip
        budgets[str(budget)] = {
            "labels": settings.splits.labels[budget],
            "arms": arms,
            "differences": {f"{a} - {b}": paired(by_seed[a], by_seed[b]).as_dict() for a, b in pairs},
            "frozen_pretrained": {key: _scores(results, names, settings.shots) for key, names in pretrained.items()},
        }
    ablation: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        if variant.name == DEFAULT_VARIANT or variant.name in settings.ablation:
            names = {s: pretrain_name(variant.name, s) for s in seeds[: settings.ablation_seeds]}
            ablation[variant.name] = {"label": variant.label, "overrides": list(variant.overrides)}
            ablation[variant.name]["validation"] = _scores(results, names, settings.shots)
    attempts = json.loads((out / "attempts.json").read_text()) if (out / "attempts.json").exists() else []
    wall_by_kind: dict[str, float] = {}
    reused = [result for result in results.values() if "reused_from" in result]
    for result in results.values():
        if "reused_from" in result:  # their time was spent, and counted, by the study they came from
            continue
        kind = kind_of(Job(result["name"], result["kind"]))
        wall_by_kind[kind] = wall_by_kind.get(kind, 0.0) + result["wall_seconds"]
    return {
        "settings": settings.as_dict(),
        "budgets": budgets,
        "ablation": ablation,
        "test_set": audit_test_reads(plan, choices, test_reads(out), joined),
        "wall_seconds": {
            "elapsed": elapsed(attempts),
            "attempts": len(attempts),
            "jobs_by_kind": wall_by_kind,
        },
        "reused": {"runs": len(reused), "from": sorted({result["reused_from"] for result in reused})},
    }


def write_results(folders: Sequence[Path], name: str, record: dict[str, Any], table: str) -> None:
    """A study's record as <name>.json and its table as <name>.md, into each folder (its run folder and
    results/, where asked)."""
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(record, indent=1))
        (folder / f"{name}.md").write_text(table + "\n")


def machine_counts(results: dict[str, dict], pinned: str | None = None) -> dict[str, int]:
    """{what a run computed on (CPU, precision, threads, torch): runs}, a resumed run once per machine. The
    precision is the one the CPU takes, or `pinned` where the runs set it (the CPU then said by its bf16)."""
    machines: dict[str, int] = {}
    for result in results.values():
        for entry in result.get("machines", []):
            threads = f"{entry['threads']} thread" + ("s" if entry["threads"] != 1 else "")
            bf16 = "with bf16 instructions" if entry["bf16"] else "without bf16 instructions"
            precision = f"{bf16}; {pinned}" if pinned else entry["precision"]
            key = f"{entry['cpu']} ({precision}, {threads}, torch {entry['torch']})"
            machines[key] = machines.get(key, 0) + 1
    return machines


def computed_on(machines: dict[str, int]) -> str:
    """The line that says what a study's runs computed on (machine_counts)."""
    counts = [f"{machine}: {n} run" + ("s" if n != 1 else "") for machine, n in machines.items()]
    return "Runs computed on: " + "; ".join(counts) + "."


def pct(summary: dict[str, Any]) -> str:
    """mean ± std in percent."""
    return f"{100 * summary['mean']:.1f} ± {100 * summary['std']:.1f}"


def interval(summary: dict[str, Any]) -> str:
    low, high = summary["low"], summary["high"]
    span = f"[{100 * low:+.1f}, {100 * high:+.1f}]" if low is not None else "(one seed)"
    return f"{100 * summary['mean']:+.1f} pts {span}"


def render(study: dict[str, Any], command: str) -> str:
    """The study as markdown: per budget the arms and the paired differences, then the ablation."""
    s = study["settings"]
    shots = [f"{n}-shot" for n in s["shots"]]
    n = len(s["seeds"])
    lines = [f"Made by `{command}`.", ""]
    for budget, numbers in study["budgets"].items():
        lines += [f"### {int(budget):,} labels", ""]
        header = ["arm", f"test top-1 (mean ± std, {n} seeds)", "lr (validation top-1 per lr)", *shots]
        header += ["k-NN", "linear probe", "steps"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for arm in numbers["arms"].values():
            grid = ", ".join(f"{lr[2:]}: {100 * v:.1f}" for lr, v in arm["val_accuracy_by_lr"].items())
            frozen = [pct(arm["frozen"][k]) for k in [*shots, "k-NN", "linear probe"]]
            steps = f"{arm['pretrain_steps']} + {arm['steps']}" if arm["pretrain_steps"] else f"{arm['steps']}"
            lines.append(
                f"| {arm['label']} | {pct(arm['test_accuracy'])} | {arm['lr']:g} ({grid}) | "
                + " | ".join(frozen)
                + f" | {steps} |"
            )
        lines += ["", "| paired difference (test top-1) | mean [95% interval over seeds] |", "|---|---|"]
        for pair, diff in numbers["differences"].items():
            a, b = pair.split(" - ")
            lines.append(f"| {ARMS[a]} − {ARMS[b]} | {interval(diff)} |")
        lines += ["", "| frozen pretrained encoder | " + " | ".join([*shots, "k-NN", "linear probe"]) + " |"]
        lines.append("|" + "---|" * (len(shots) + 3))
        for key, scores in numbers["frozen_pretrained"].items():
            cells = [pct(scores[k]) for k in [*shots, "k-NN", "linear probe"]]
            lines.append(f"| {FROZEN_LABELS[key]} | " + " | ".join(cells) + " |")
        lines.append("")
    if study["ablation"]:
        seeds = s["ablation_seeds"]
        lines += [
            f"### Ablation of the pretraining objective (frozen encoder, validation split, {seeds} seeds)",
            "",
            "| objective | " + " | ".join([*shots, "k-NN", "linear probe"]) + " |",
            "|" + "---|" * (len(shots) + 3),
        ]
        for variant in study["ablation"].values():
            cells = [pct(variant["validation"][k]) for k in [*shots, "k-NN", "linear probe"]]
            lines.append(f"| {variant['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    audit, wall = study["test_set"], study["wall_seconds"]
    lines += [
        f"Test set: read {audit['reads']} times by {audit['evaluations']} final evaluations, "
        + (f"with problems: {'; '.join(audit['problems'])}." if audit["problems"] else "all after the last choice.")
        + (
            f" Arms added to the study later (their learning rates chosen on validation after the other arms' test "
            f"reads): {', '.join(ARMS[a] for a in audit['arms_added_later'])}."
            if audit.get("arms_added_later")
            else ""
        ),
        f"Wall time: {wall['elapsed'] / 60:.0f} min over {wall['attempts']} invocation(s) "
        f"(run time by kind: {', '.join(f'{k} {v / 60:.0f} min' for k, v in wall['jobs_by_kind'].items())})"
        + (
            f"; {study['reused']['runs']} finished runs brought from {', '.join(study['reused']['from'])}, not counted."
            if study.get("reused", {}).get("runs")
            else "."
        ),
    ]
    return "\n".join(lines)


def plot_accuracy(study: dict[str, Any], path: Path) -> None:
    """Test top-1 per arm and budget: bars of the mean, error bars of the std over seeds."""
    budgets = list(study["budgets"])
    figure, axes = plt.subplots(figsize=(7, 4), dpi=120)
    present = [arm for arm in ARMS if any(arm in b["arms"] for b in study["budgets"].values())]
    width = 0.8 / len(present)
    for index, arm in enumerate(present):
        xs, means, stds = [], [], []
        for position, budget in enumerate(budgets):
            numbers = study["budgets"][budget]["arms"].get(arm)
            if numbers:
                xs.append(position + (index - (len(present) - 1) / 2) * width)
                means.append(100 * numbers["test_accuracy"]["mean"])
                stds.append(100 * numbers["test_accuracy"]["std"])
        axes.bar(xs, means, width, yerr=stds, capsize=3, label=ARMS[arm])
    axes.set_xticks(range(len(budgets)), [f"{int(b):,} labels" for b in budgets])
    axes.set_ylabel("test top-1 (%)")
    low = min(100 * a["test_accuracy"]["mean"] for b in study["budgets"].values() for a in b["arms"].values())
    axes.set_ylim(max(0, low - 15), None)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_curves(study: dict[str, Any], path: Path) -> None:
    """Validation top-1 against optimiser steps (pretraining included), mean over seeds with a ±std band."""
    budgets = list(study["budgets"])
    figure, all_axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4), dpi=120, squeeze=False)
    for axes, budget in zip(all_axes[0], budgets):
        for arm in study["budgets"][budget]["arms"].values():
            curves = list(arm["val_curves"].values())
            steps = [step for step, _ in curves[0]]
            values = [[100 * v for _, v in curve] for curve in curves if len(curve) == len(steps)]
            mean = [sum(column) / len(column) for column in zip(*values)]
            std = [
                (sum((v - m) ** 2 for v in column) / max(1, len(column) - 1)) ** 0.5
                for column, m in zip(zip(*values), mean)
            ]
            (line,) = axes.plot(steps, mean, marker="o", markersize=3, label=arm["label"])
            axes.fill_between(
                steps,
                [m - d for m, d in zip(mean, std)],
                [m + d for m, d in zip(mean, std)],
                color=line.get_color(),
                alpha=0.2,
            )
        axes.set_title(f"{int(budget):,} labels")
        axes.set_xlabel("optimiser steps, pretraining included")
        axes.set_ylabel("validation top-1 (%)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
