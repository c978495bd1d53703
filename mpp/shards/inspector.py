"""Read shards back to count, describe and verify them."""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from braceexpand import braceexpand
from PIL import Image

from mpp.shards.format import SHARD_NAME, ShardError, parse_index, sidecar_name
from mpp.shards.images import IMAGE_EXTENSIONS
from mpp.shards.tar import EmptyFileError, MemberOrderError, iter_samples


@dataclass
class Inspection:
    """What `inspect_shards` found: samples per shard, labels, image sizes/modes, problems."""

    shards: dict[str, int] = field(default_factory=dict)
    labels: Counter[int | None] = field(default_factory=Counter)
    sizes: Counter[tuple[int, int]] = field(default_factory=Counter)
    modes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # "<shard>:<key>: <reason>" or "<file>: <reason>"
    classes: list[str] | None = None

    @property
    def total(self) -> int:
        """Samples in all the shards read."""
        return sum(self.shards.values())


def _load_sidecar(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as error:
        raise ShardError(f"{path}: unreadable sidecar ({error})") from None
    return parse_index(text, str(path))


def resolve_shards(specs: Sequence[str]) -> tuple[list[Path], dict[Path, dict[str, Any]], set[Path]]:
    """Expand paths, brace patterns and sidecars; return shards, their sidecars, sidecars given."""
    shards: list[Path] = []
    sidecars: dict[Path, dict[str, Any]] = {}
    for spec in specs:
        if "://" in spec or spec.startswith("pipe:"):
            raise ShardError(f"{spec}: only local shard files can be inspected")
        for name in braceexpand(spec):
            path = Path(name)
            if path.suffix == ".json":
                sidecars[path] = _load_sidecar(path)
                shards += [path.parent / s["name"] for s in sidecars[path]["shards"]]
            else:
                shards.append(path)
    given = set(sidecars)
    for path in shards:  # a shard named like ours finds its sidecar next to it
        match = SHARD_NAME.fullmatch(path.name)
        candidate = path.parent / sidecar_name(match["prefix"]) if match else None
        if candidate and candidate not in sidecars and candidate.is_file():
            sidecars[candidate] = _load_sidecar(candidate)
    return list(dict.fromkeys(shards)), sidecars, given


def _check_sample(
    shard: Path, key: str, members: dict[str, bytes], report: Inspection, verify: bool, labelled: bool
) -> None:
    """Count one sample into `report`, appending a problem for each thing wrong with it."""
    problems: list[str] = []
    images = [ext for ext in members if ext in IMAGE_EXTENSIONS]
    if not images:
        problems.append(f"no image member (has {sorted(members) or 'nothing'})")
    for ext in images:
        try:
            with Image.open(io.BytesIO(members[ext])) as image:
                if verify:
                    image.load()
                report.sizes[image.size] += 1
                report.modes[image.mode] += 1
        # PIL signals bad data with many exception types; any of them means the sample is broken.
        except Exception as error:  # noqa: BLE001
            problems.append(f"cannot decode .{ext} ({type(error).__name__}: {error})")
    label = None
    if "cls" in members:
        text = members["cls"].decode("ascii", "replace").strip()
        if not text.isdigit():
            problems.append(f".cls {members['cls'][:20]!r} is not a decimal class index")
        elif report.classes is not None and int(text) >= len(report.classes):
            problems.append(f"class {text} out of range for {len(report.classes)} classes")
        else:
            label = int(text)
    elif labelled and verify:
        problems.append("no .cls although the sidecar lists classes")
    report.labels[label] += 1
    report.problems += [f"{shard}:{key}: {reason}" for reason in problems]


def _read_shard(shard: Path, report: Inspection, verify: bool, labelled: bool, seen: dict[str, Path]) -> int:
    """Check every sample of one tar (gzip-compressed or not), grouped as the loader groups them;
    report damage with how many complete samples were read before it."""
    count = 0
    try:
        with shard.open("rb") as file:
            for sample in iter_samples(file):
                key = sample.pop("__key__")
                count += 1
                if verify:  # duplicate keys confuse anything that joins on keys later
                    if key in seen:
                        report.problems.append(f"{shard}:{key}: key already used in {seen[key]}")
                    seen[key] = shard
                _check_sample(shard, key, sample, report, verify, labelled)
    except MemberOrderError as error:
        report.problems.append(f"{shard}: members out of order after {count} samples: {error}")
    except EmptyFileError as error:
        report.problems.append(f"{shard}: {error}")
    # As in the loader, the sample in hand where a tar breaks off is not counted: it may lack a member.
    except tarfile.ReadError as error:
        report.problems.append(f"{shard}: truncated or garbled after {count} complete samples ({error})")
    except OSError as error:
        report.problems.append(f"{shard}: unreadable after {count} complete samples ({error})")
    return count


def inspect_shards(specs: Sequence[str], verify: bool = False) -> Inspection:
    """Count and (with `verify`) fully decode every sample of the given shards or sidecars."""
    shards, sidecars, given = resolve_shards(specs)
    report = Inspection()
    listed: dict[Path, dict[str, Any]] = {}
    for path, sidecar in sidecars.items():
        report.classes = report.classes or sidecar.get("classes")
        listed.update({path.parent / s["name"]: s for s in sidecar["shards"]})
    seen: dict[str, Path] = {}
    for shard in shards:
        if not shard.is_file():
            report.problems.append(f"{shard}: no such shard file")
            continue
        entry = listed.get(shard)
        report.shards[str(shard)] = _read_shard(
            shard, report, verify, entry is not None and report.classes is not None, seen
        )
        if entry and entry["samples"] != report.shards[str(shard)]:
            report.problems.append(f"{shard}: {report.shards[str(shard)]} samples, sidecar says {entry['samples']}")
        if entry and entry.get("bytes") not in (None, shard.stat().st_size):
            report.problems.append(f"{shard}: {shard.stat().st_size} bytes, sidecar says {entry['bytes']}")
    for path in given:
        sidecar = sidecars[path]
        if sum(s["samples"] for s in sidecar["shards"]) != sidecar["samples"]:
            report.problems.append(f"{path}: shard counts do not add up to samples={sidecar['samples']}")
    return report


def listed_classes(urls: Sequence[str]) -> tuple[list[str], list[Path]] | None:
    """The class names the sidecars of these shards list, and those sidecars: for local shards named
    like mpp's (`train-000003.tar` finds `train.json`). None where no sidecar lists classes (other
    tools' tars, URLs); sidecars that list different classes are an error naming both."""
    found: dict[Path, list[str]] = {}
    for url in urls:
        match = SHARD_NAME.fullmatch(Path(url).name) if "://" not in url and not url.startswith("pipe:") else None
        candidate = Path(url).parent / sidecar_name(match["prefix"]) if match else None
        if candidate is not None and candidate not in found and candidate.is_file():
            classes = _load_sidecar(candidate).get("classes")
            if classes is not None:
                found[candidate] = list(classes)
    if not found:
        return None
    (first, classes), *others = found.items()
    for path, other in others:
        if other != classes:
            raise ShardError(f"{first} lists classes {classes} and {path} lists {other}: name shards of one labelling")
    return classes, list(found)
