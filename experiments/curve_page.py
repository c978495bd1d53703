"""The pretraining-budget curve's page (experiments.curve): the markdown table of its record, with the
conclusions its intervals carry (`render`), and its picture (`plot`). The record is
experiments.curve_report's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.curve_plan import LABELS, SCRATCH_ARMS  # noqa: E402
from experiments.report import computed_on, interval, pct  # noqa: E402

PAIRS = {"mpp - plateau": ("mpp", "plateau"), "mpp - matched": ("mpp", "matched"),
         "supervised - mpp": ("supervised", "mpp")}  # fmt: skip
NAMES = {"mpp": "MPP fine-tuned", "plateau": "from scratch, plateau", "matched": "from scratch, matched compute",
         "supervised": "supervised pretrained, fine-tuned"}  # fmt: skip


def within_budgets(within: dict[str, dict[str, Any]]) -> str:
    """'; within a budget (its seeds only): 600: +0.35 (5), ...', for the budgets with an r of their own."""
    named = [
        f"{int(budget):,}: {entry['pearson_r']:+.2f} ({entry['n']})"
        for budget, entry in within.items()
        if entry["pearson_r"] is not None
    ]
    return "; within a budget (its seeds only): " + ", ".join(named) if named else ""


def cell(entry: dict[str, Any] | None, seeds: int) -> str:
    """mean ± std [95% interval], and the number of seeds where it is not the curve's."""
    if not entry:
        return "–"
    span = f" [{100 * entry['low']:.1f}, {100 * entry['high']:.1f}]" if entry["low"] is not None else ""
    return pct(entry) + span + (f" ({entry['n']} seeds)" if entry["n"] != seeds else "")


def render(record: dict[str, Any], command: str) -> str:
    c, points, rows = record["curve"], record["points"], record["rows"]
    seeds, tune = len(c["study"]["seeds"]), c["study"]["finetune_steps"]
    plateau = record["plateau"]
    lines = [
        f"Made by `{command}`. The plan, with the first grids (extensions and added seeds add runs): "
        + "; ".join(record["plan"])
        + ".",
        "",
        computed_on(record["machines"]),
        "",
    ]
    lines += [
        f"### Test top-1 at {LABELS:,} labels against pretraining steps (mean ± std [95% interval], {seeds} seeds)",
        "",
    ]
    header = ["pretraining steps", NAMES["mpp"], NAMES["supervised"], f"{NAMES['matched']} (steps)", "MPP − plateau",
              "MPP − matched", "supervised − MPP"]  # fmt: skip
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for budget, row in rows.items():
        arms, diffs = row["arms"], row["differences"]
        if not arms:
            continue
        lines.append(
            f"| {int(budget):,} | {cell(arms.get('mpp'), seeds)} | {cell(arms.get('supervised'), seeds)} | "
            f"{cell(arms.get('matched'), seeds)} ({int(budget) + tune:,}) | "
            + " | ".join(interval(diffs[key]) if key in diffs else "–" for key in PAIRS)
            + " |"
        )
    for arm, title in (("scratch", "From scratch"), ("hybrid", "Hybrid (ViT on a ResNet stem) from scratch")):
        lines += by_steps(record, arm, title, seeds)
    lines += ["", "### Pretrained encoders: frozen on the test set, and the pretraining loss", "",
              "| pretraining | steps | lr chosen (validation top-1 per lr) | k-NN | linear probe | pretraining validation loss |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for point, entry in points.items():
        if entry and point.split("/")[0] not in SCRATCH_ARMS:
            arm, size = point.split("/p")
            loss = entry["pretrain_val_loss"]
            shown = f"{loss['mean']:.4f} ± {loss['std']:.4f}" if loss else "–"
            frozen = entry["frozen"]
            lines.append(
                f"| {arm} | {int(size):,} | {lrs(entry)} | {pct(frozen['k-NN'])} | {pct(frozen['linear probe'])} | {shown} |"
            )
    lines += recipe_table(record.get("recipe"))
    lines += ["", "### What the intervals carry", ""]
    lines += [f"- {text}." for text in record["conclusions"].values()]
    if record["widened"]:
        lines.append(
            f"- Given {c['more_seeds']} more seeds because a paired interval over the first {seeds} held zero (so"
            f" the number of seeds depended on those test numbers): {', '.join(record['widened'])}."
        )
    for name, found in (("from-scratch", plateau), ("hybrid from-scratch", record.get("hybrid_plateau"))):
        if found:
            edge = ", the top of its grid: more steps might still help" if found["edge"] else ""
            lines.append(f"- The {name} plateau: {found['steps']:,} steps{edge}.")
    if record.get("hybrid"):
        lines.append(
            "- Hybrid from scratch − from scratch, each at its plateau: "
            + interval(record["hybrid"]["hybrid - plateau"])
            + f" ({record['hybrid']['hybrid - plateau']['n']} seeds)."
        )
    if record["loss_predicts"] and record["loss_predicts"]["pearson_r"] is not None:
        r = record["loss_predicts"]
        lines.append(
            f"- MPP's pretraining validation loss against its fine-tuned test top-1: Pearson r = {r['pearson_r']:.2f} over {r['n']} runs"
            + within_budgets(r.get("within", {}))
            + "."
        )
    audit, wall = record["test_set"], record["wall_seconds"]
    problems = (
        f"with problems: {'; '.join(audit['problems'])}" if audit["problems"] else "each after its point's choice"
    )
    if audit.get("untimed"):
        problems += f" ({audit['untimed']} reads restored without times, audited when they were made)"
    done = f"{audit['evaluations_done']} of the {audit['evaluations']}"
    lines += [f"- {n} runs restored: {note}." for note, n in record.get("restored", {}).items()]
    for name, run in record.get("remade", {}).items():
        (first, again), (cpu, remade_cpu) = run["val_accuracy"], run["cpu"]
        lines.append(f"- {name}: made again for its test (restored without its weights); validation "
                     f"{first:.1%} as chosen ({cpu}), {again:.1%} remade ({remade_cpu}).")  # fmt: skip
    if record.get("ahead_unwanted"):
        lines.append("- Runs made ahead in a slot that would have waited, which their grid does not want so far"
                     f" (their time counts in the wall time): {', '.join(record['ahead_unwanted'])}.")  # fmt: skip
    lines += ["", f"Test set: read {audit['reads']} times, by {done} final evaluations the choices so far call for, {problems}.",
              f"Wall time: {wall['elapsed'] / 3600:.1f} h over {wall['attempts']} invocation(s) (run time by kind: "
              + ", ".join(f"{k} {v / 3600:.1f} h" for k, v in wall["jobs_by_kind"].items()) + ")."]  # fmt: skip
    return "\n".join(lines)


def recipe_table(recipe: dict[str, Any] | None) -> list[str]:
    """The screen's confirmed recipe (experiments.screen) against from scratch with its own kept recipe, per
    pretraining budget; nothing before the confirmation has a point."""
    if not recipe or not recipe["points"]:
        return []
    kept = {arm: ", ".join(f"{k}={v}" for k, v in entry["recipe"].items()) for arm, entry in recipe["recipes"].items()}
    scratch = next(((p, e) for p, e in recipe["points"].items() if p.startswith("scratch/")), None)
    steps = f"{int(scratch[0].split('/s')[1]):,} steps" if scratch else "–"
    lines = ["", "### The screen's recipe, confirmed (float32 on any CPU; the paper's recipe above)", "",
             f"Made by `{recipe['command']}`. MPP: {kept['mpp']}; from scratch: {kept['scratch']}.", "",
             f"| pretraining steps | MPP, the screen's recipe, fine-tuned | k-NN | linear probe | from scratch, its own "
             f"recipe ({steps}) | MPP − from scratch |", "|---|---|---|---|---|---|"]  # fmt: skip
    for point, entry in recipe["points"].items():
        if point.startswith("mpp/"):
            budget = point.split("/p")[1]
            found = scratch[1]["test_accuracy"] if scratch else None
            diff = recipe["differences"].get(budget)
            frozen = [pct(entry["frozen"][key]) for key in ("k-NN", "linear probe")]
            lines.append(f"| {int(budget):,} | {cell(entry['test_accuracy'], 0)} | {frozen[0]} | {frozen[1]} | "
                         f"{cell(found, 0)} | {interval(diff) if diff else '–'} |")  # fmt: skip
    return lines


def by_steps(record: dict[str, Any], arm: str, title: str, seeds: int) -> list[str]:
    """The table of a from-scratch arm's step counts, its plateau marked; none before its first choice."""
    plateau = record["plateau"] if arm == "scratch" else record.get("hybrid_plateau")
    rows = []
    for point, entry in record["points"].items():
        if point.startswith(arm + "/") and entry:
            steps = int(point.split("/s")[1])
            mark = " (plateau)" if plateau and plateau["steps"] == steps else ""
            rows.append(
                f"| {steps:,}{mark} | {lrs(entry)} | {pct(entry['validation'])} | {cell(entry['test_accuracy'], seeds)} |"
            )
    head = ["", f"### {title}, by steps (the plateau is the best on validation)", "",
            "| steps | lr (validation top-1 per lr, first seed) | validation top-1 | test top-1 |", "|---|---|---|---|"]  # fmt: skip
    return head + rows if rows else []


def lrs(entry: dict[str, Any]) -> str:
    grid = ", ".join(f"{lr[2:]}: {100 * v:.1f}" for lr, v in entry["val_accuracy"].items())
    return f"{entry['lr']:g} ({grid})" + (" at the edge" if entry["edge"] else "")


def plot(record: dict[str, Any], path: Path) -> None:
    """Fine-tuned test top-1 against pretraining steps (log) with 95% intervals, the plateau as a band;
    the frozen encoders; the pretraining loss against the fine-tuned accuracy."""
    rows, points = record["rows"], record["points"]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5), dpi=110)
    colours = {"mpp": "C0", "supervised": "C1", "matched": "C2"}  # an arm's colour in every panel
    for arm, marker, shift in (("mpp", "o", 1.0), ("supervised", "s", 1.05), ("matched", "^", 0.95)):
        xs = [int(b) * shift for b, row in rows.items() if arm in row["arms"]]  # side by side on the log axis
        found = [row["arms"][arm] for row in rows.values() if arm in row["arms"]]
        if xs:
            means = [100 * f["mean"] for f in found]
            errors = [100 * (f["high"] - f["mean"]) if f["high"] is not None else 0 for f in found]
            left.errorbar(xs, means, yerr=errors, marker=marker, capsize=3, color=colours[arm], label=NAMES[arm])
    plateau = next((row["arms"]["plateau"] for row in rows.values() if "plateau" in row["arms"]), None)
    if plateau:
        steps = record["plateau"]["steps"]
        low, high = (plateau["low"], plateau["high"]) if plateau["low"] is not None else (plateau["mean"],) * 2
        left.axhspan(
            100 * low, 100 * high, color="grey", alpha=0.25, label=f"from scratch, plateau ({steps:,} steps), 95%"
        )
        left.axhline(100 * plateau["mean"], color="grey", lw=1)
    hybrid = record.get("hybrid")
    if hybrid:
        found = hybrid["test_accuracy"]
        low, high = (found["low"], found["high"]) if found["low"] is not None else (found["mean"],) * 2
        label = f"hybrid from scratch, plateau ({hybrid['steps']:,} steps), 95%"
        left.axhspan(100 * low, 100 * high, color="C8", alpha=0.2, label=label)
        left.axhline(100 * found["mean"], color="C8", lw=1)
    recipe = record.get("recipe")
    mine = sorted(
        (int(p.split("/p")[1]), e) for p, e in (recipe or {}).get("points", {}).items() if p.startswith("mpp/")
    )
    if mine:
        found = [entry["test_accuracy"] for _, entry in mine]
        errors = [100 * (f["high"] - f["mean"]) if f["high"] is not None else 0 for f in found]
        left.errorbar([budget for budget, _ in mine], [100 * f["mean"] for f in found], yerr=errors, marker="D",
                      capsize=3, color="C6", label="MPP, the screen's recipe, fine-tuned (float32)")  # fmt: skip
    scratch = next((e for p, e in (recipe or {}).get("points", {}).items() if p.startswith("scratch/")), None)
    if scratch:
        found = scratch["test_accuracy"]
        low, high = (found["low"], found["high"]) if found["low"] is not None else (found["mean"],) * 2
        left.axhspan(100 * low, 100 * high, facecolor="none", edgecolor="C6", hatch="//", alpha=0.5,
                     label="from scratch, its own recipe (float32), 95%")  # fmt: skip
    left.set(xscale="log", xlabel="pretraining steps", ylabel=f"test top-1 at {LABELS:,} labels (%)")
    left.set_title("fine-tuned, 95% interval over seeds", fontsize=10)
    for arm in ("mpp", "supervised"):
        for key, style, marker in (("linear probe", "-", "o"), ("k-NN", "--", "s")):
            found = sorted(
                ((int(p.split("/p")[1]), e["frozen"][key]) for p, e in points.items() if p.startswith(arm + "/") and e),
                key=lambda budget_and_scores: budget_and_scores[0],
            )
            if found:
                middle.errorbar([x for x, _ in found], [100 * f["mean"] for _, f in found],
                                yerr=[100 * f["std"] for _, f in found], ls=style, marker=marker, capsize=3,
                                color=colours[arm], label=f"{arm}, {key}")  # fmt: skip
    for key, style, marker in (("linear probe", "-", "D"), ("k-NN", "--", "d")) if mine else ():
        middle.errorbar([budget for budget, _ in mine], [100 * e["frozen"][key]["mean"] for _, e in mine],
                        yerr=[100 * e["frozen"][key]["std"] for _, e in mine], ls=style, marker=marker, capsize=3,
                        color="C6", label=f"mpp, the screen's recipe, {key}")  # fmt: skip
    middle.set(xscale="log", xlabel="pretraining steps", ylabel="frozen encoder, test top-1 (%)")
    middle.set_title("frozen encoders (mean ± std)", fontsize=10)
    measured = [(p, e) for p, e in points.items() if p.startswith("mpp/") and e and e.get("pretrain_val_loss")]
    for budget, (point, entry) in enumerate(measured):  # budgets in colours that no arm has
        right.scatter(entry["pretrain_val_loss"]["values"], [100 * v for v in entry["test_accuracy"]["values"]],
                      color=f"C{3 + budget}", label=f"{int(point.split('/p')[1]):,} steps")  # fmt: skip
    right.set(xlabel="MPP pretraining validation loss", ylabel="fine-tuned test top-1 (%)")
    right.set_title("is the loss a cheap predictor? (one dot per seed)", fontsize=10)
    for axes in (left, middle, right):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
