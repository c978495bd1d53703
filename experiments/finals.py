"""What a chosen point of a curve or a confirmation measured with its final runs (`numbers`), and whether the
test set was read only as it should be (`audit`): by the final evaluations of chosen points, each once, a
final run's test after its point's choice."""

from __future__ import annotations

from typing import Any, Protocol

from experiments.plan import Job, lr_name
from experiments.stats import summarise


class Chooser(Protocol):
    """What an audit asks of a plan (experiments.curve_plan.CurvePlan, experiments.confirm_plan.Confirmation):
    the final evaluations of a point chosen at `lr`, and the seeds a point has."""

    def evaluations(self, point: str, lr: float, seeds: tuple[int, ...] | None = None) -> list[Job]: ...

    def seeds(self, point: str, widened: set[str]) -> tuple[int, ...]: ...


def numbers(
    choice: dict[str, Any], finals: dict[int, Job], sources: list[str], results: dict[str, dict]
) -> dict[str, Any] | None:
    """A chosen point's numbers over the seeds of `finals` ({seed: final run}) and, for a pretrained point, of
    its pretraining runs `sources` (their frozen evaluations and validation loss); None until every final run
    has its test and every pretraining run its frozen evaluation."""
    if any(job.name + "/test" not in results for job in finals.values()):
        return None
    tests: dict[int, float] = {seed: results[job.name + "/test"]["test_accuracy"] for seed, job in finals.items()}
    entry: dict[str, Any] = {
        **{key: choice[key] for key in ("lr", "val_accuracy", "grid", "extended", "edge") if key in choice},
        "validation": summarise([results[job.name]["val_accuracy"] for job in finals.values()]).as_dict(),
        "test_accuracy": summarise(list(tests.values())).as_dict(),
        "test_accuracy_by_seed": {str(seed): value for seed, value in tests.items()},
        "wall_seconds": sum(results[job.name]["wall_seconds"] for job in finals.values()) / len(finals),
    }
    if sources:
        frozen = [results.get(f"frozen/{source}", {}).get("frozen") for source in sources]
        if any(scores is None for scores in frozen):
            return None
        entry["frozen"] = {key: summarise([f[name] for f in frozen]).as_dict()  # type: ignore[index]
                           for key, name in (("k-NN", "knn"), ("linear probe", "linear"))}  # fmt: skip
        losses = [results[source]["val_loss"] for source in sources if results[source].get("val_loss") is not None]
        entry["pretrain_val_loss"] = summarise(losses).as_dict() if len(losses) == len(sources) else None
        entry["pretrain_wall_seconds"] = sum(results[source]["wall_seconds"] for source in sources) / len(sources)
    return entry


def _earlier_choice(job: str, choices: dict[str, Any]) -> str | None:
    """The learning rate of a final run's test (b<labels>/<point>/lr<lr>/seed<n>/test) whose point has
    chosen another since (its grid grew past its edge after the read), else None."""
    parts = job.split("/")
    if len(parts) != 6 or parts[-1] != "test" or not parts[3].startswith("lr"):
        return None
    choice = choices.get("/".join(parts[1:3]))
    return parts[3] if choice and lr_name(choice["lr"]) != parts[3] else None


def audit(
    plan: Chooser, choices: dict[str, Any], reads: list[dict[str, Any]], widened: set[str] | None = None
) -> dict[str, Any]:
    """Whether the test set was read only by evaluations of chosen points (with the seeds `widened` adds),
    each once, a final run's test after its point's choice (a frozen encoder's evaluation depends on no
    choice: it evaluates the pretraining run)."""
    evaluations = [(job, point) for point, choice in choices.items() if choice and not point.endswith("/plateau")
                   for job in plan.evaluations(point, choice["lr"], plan.seeds(point, widened or set()))]  # fmt: skip
    owner = {job.name: point for job, point in evaluations}
    chosen = {job.name for job, _ in evaluations if job.kind == "test"}  # what its point's choice decides
    counts: dict[str, int] = {}
    problems = []
    for read in reads:
        counts[read["job"]] = counts.get(read["job"], 0) + 1
        point = owner.get(read["job"])
        if point is None:
            earlier = _earlier_choice(read["job"], choices)
            what = f"at {earlier}, which its point no longer chooses" if earlier else "but is no final evaluation"
            problems.append(f"{read['job']} read the test set {what}")
        elif (
            read["job"] in chosen
            and None not in (read["time"], choices[point]["time"])
            and read["time"] < choices[point]["time"]
        ):
            problems.append(f"{read['job']} read the test set before its point's choice")
    problems += [f"{name} read the test set {n} times" for name, n in counts.items() if n > 1]
    done = len({read["job"] for read in reads} & set(owner))
    untimed = sum(read["time"] is None for read in reads)  # restored from a record that audited them
    return {"reads": len(reads), "evaluations": len(owner), "evaluations_done": done, "problems": problems,
            "untimed": untimed}  # fmt: skip
