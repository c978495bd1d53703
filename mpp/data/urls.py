"""Shard specs -> shard URLs, when the config is read: brace patterns, local globs, checks.

A local shard must exist and be a file (a folder is answered with the patterns to give
instead); s3://, gs:// and http(s):// URLs are taken as written (mpp.data.remote reads them);
pipe: URLs run shell commands and are refused unless the config allows them.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Sequence

import braceexpand

from mpp.shards.images import IMAGE_EXTENSIONS

REMOTE_SCHEMES = ("http", "https", "s3", "gs")
log = logging.getLogger("mpp")


def expand_urls(spec: str | Sequence[str], *, allow_pipe: bool = False) -> list[str]:
    """A shard spec (path, brace pattern, local glob, URL, or a list of those) -> the list of shard URLs.

    Local shards must exist; `pipe:` commands are refused unless `allow_pipe`.
    """
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items:
        raise ValueError("the shard list is empty: give a path, a brace pattern or a URL")
    urls: list[str] = []
    for item in items:
        for url in braceexpand.braceexpand(item):
            urls.extend(_checked(url, item, allow_pipe))
    return urls


def check_repeated(split: str, urls: Sequence[str]) -> None:
    """A shard named twice is read twice: a warning for training, an error where it would skew the metrics."""
    counts: dict[str, int] = {}
    for url in urls:  # a local file by any of its paths
        key = os.path.realpath(url) if "://" not in url and not url.startswith("pipe:") else url
        counts[key] = counts.get(key, 0) + 1
    named = ", ".join(f"{url} ({count} times)" for url, count in counts.items() if count > 1)
    if named and split == "train":
        log.warning("data.train names %s: each is read that many times per epoch", named)
    elif named:
        raise ValueError(f"names {named}: their samples would count that many times in the metrics; name each once")


def _checked(url: str, item: str, allow_pipe: bool) -> list[str]:
    """One expanded entry -> its shard URLs, or an error saying what is wrong with it."""
    if url.startswith("pipe:"):
        check_pipe_allowed(url, allow_pipe=allow_pipe)
        return [url]
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in REMOTE_SCHEMES:
        return [url]
    if scheme not in ("", "file"):
        raise ValueError(f"shard {url!r}: unsupported scheme {scheme!r}; use a path, http(s)://, s3://, gs:// or pipe:")
    path = url[len("file://") :] if scheme == "file" else url
    if glob.has_magic(path):
        matches = sorted(glob.glob(path))
        if not matches:
            raise FileNotFoundError(f"shard pattern {item!r} matches no file{_relative(path)}")
        return matches
    if os.path.isdir(path):
        raise IsADirectoryError(f"shard {path} is a folder, not a tar file: {folder_patterns(path)}")
    if not os.path.isfile(path):
        origin = "" if item == url else f" (from {item!r})"
        raise FileNotFoundError(f"shard {path}{origin} does not exist{_relative(path)}")
    return [path]


def folder_patterns(folder: str) -> str:
    """What to give instead of a folder: a brace pattern for each run of numbered tars in it."""
    runs: dict[tuple[str, str], list[str]] = {}
    for name in sorted(os.listdir(folder)):
        if match := re.fullmatch(r"(.*?)(\d+)(\.tar|\.tar\.gz|\.tgz)", name):
            runs.setdefault((match.group(1), match.group(3)), []).append(match.group(2))
    if not runs and holds_images(folder):
        return (
            f"it holds images, not shards: write shards from them with "
            f"`python tools/make_shards.py folder {folder} --out shards/<name> --holdout 0.1` and give those"
        )
    if not runs:
        return "it holds no numbered .tar shards; give a path, a brace pattern or a glob of tar files"
    base = folder.rstrip("/")
    patterns = []
    for (prefix, suffix), numbers in runs.items():
        numbered = [int(n) for n in numbers]
        contiguous = numbered == list(range(numbered[0], numbered[0] + len(numbered)))
        if len(numbers) == 1:
            patterns.append(f"'{base}/{prefix}{numbers[0]}{suffix}'")
        elif contiguous and len({len(n) for n in numbers}) == 1:
            patterns.append(f"'{base}/{prefix}{{{numbers[0]}..{numbers[-1]}}}{suffix}'")
        else:
            patterns.append(f"'{base}/{prefix}*{suffix}'")
    return "give its shards as a pattern, e.g. " + " or ".join(patterns)


def holds_images(folder: str) -> bool:
    """Whether a folder holds image files, itself or in its sub-folders (the class folders of a labelled set)."""
    for _, _, names in os.walk(folder):
        if any(os.path.splitext(name)[1].lower().lstrip(".") in IMAGE_EXTENSIONS for name in names):
            return True
    return False


def _relative(path: str) -> str:
    return "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"


def check_pipe_allowed(url: str, *, allow_pipe: bool) -> None:
    """Refuse a `pipe:` URL unless the config opted in: it runs an arbitrary shell command."""
    if url.startswith("pipe:") and not allow_pipe:
        raise ValueError(
            f"refusing shard {url!r}: pipe: URLs run shell commands; "
            "set allow_pipe=True in the data config if you trust this command"
        )
