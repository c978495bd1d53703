"""Shard specs -> shard URLs, when the config is read: brace patterns, local globs, shard indexes, checks.

A local shard must exist and be a file (a folder is answered with the patterns to give
instead); s3://, gs:// and http(s):// URLs are taken as written (mpp.data.remote reads them);
pipe: URLs run shell commands and are refused unless the config allows them. A shard index
(`train.json`, the sidecar `mpp shards write` writes), local or remote, stands for the shards
it lists, beside it, and their sample counts.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import braceexpand

from mpp.data.remote import check_pipe_allowed, open_url
from mpp.shards.format import INDEX_HINT, ShardError, parse_index
from mpp.shards.images import IMAGE_EXTENSIONS

REMOTE_SCHEMES = ("http", "https", "s3", "gs")
INDEX_LIMIT = 64 << 20  # bytes: a file bigger than this is no shard index
log = logging.getLogger("mpp")


@dataclass(frozen=True)
class ShardSet:
    """A split's shard URLs, and the samples they hold where shard indexes name them all (else None)."""

    urls: list[str]
    samples: int | None


def expand_shards(spec: str | Sequence[str], *, allow_pipe: bool = False) -> ShardSet:
    """A shard spec (path, brace pattern, local glob, URL, shard index, or a list of those) -> its shards.

    Local shards must exist; `pipe:` commands are refused unless `allow_pipe`.
    """
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items:
        raise ValueError("the shard list is empty: give a path, a brace pattern or a URL")
    urls: list[str] = []
    samples: int | None = 0
    for item in items:
        for url in braceexpand.braceexpand(item):
            if is_index(url):
                listed, count = index_shards(url)
                urls.extend(listed)
                samples = None if samples is None else samples + count
            else:
                urls.extend(_checked(url, item, allow_pipe))
                samples = None
    return ShardSet(urls, samples)


def expand_urls(spec: str | Sequence[str], *, allow_pipe: bool = False) -> list[str]:
    """A shard spec -> the list of shard URLs (see expand_shards)."""
    return expand_shards(spec, allow_pipe=allow_pipe).urls


def names_indexes(spec: str | Sequence[str] | None) -> bool:
    """Whether a shard spec names shard indexes only (so that their sample counts are known)."""
    items = [spec] if isinstance(spec, str) else list(spec or [])
    return bool(items) and all(is_index(url) for item in items for url in braceexpand.braceexpand(item))


def is_index(url: str) -> bool:
    """Whether a path or URL names a shard index: a .json file (the query of an http(s) URL aside)."""
    if url.startswith("pipe:"):
        return False
    return urllib.parse.urlsplit(url).path.endswith(".json") if "://" in url else url.endswith(".json")


def index_shards(url: str) -> tuple[list[str], int]:
    """A shard index, local or remote -> the URLs of the shards it lists (beside it) and their samples."""
    index = read_index(url)
    if not index["shards"]:
        raise ValueError(f"shard index {url} lists no shards")
    shards = [_beside(url, entry["name"]) for entry in index["shards"]]
    for shard in shards:
        if "://" not in shard and not os.path.isfile(shard):
            raise FileNotFoundError(f"shard {shard} (listed in {url}) does not exist")
    return shards, sum(entry["samples"] for entry in index["shards"])


def index_classes(url: str) -> list[str] | None:
    """The class names a shard index, local or remote, lists; None where it lists none."""
    classes = read_index(url).get("classes")
    return None if classes is None else [str(name) for name in classes]


def read_index(url: str) -> dict[str, Any]:
    """A shard index, local or remote, read and checked; a ValueError saying what it is where it is none."""
    try:
        return parse_index(_read_index(url), url)
    except ShardError as error:
        raise ValueError(str(error)) from None


def _read_index(url: str) -> bytes:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in REMOTE_SCHEMES:
        with open_url(url) as stream:
            data = stream.read(INDEX_LIMIT + 1)
    elif scheme in ("", "file"):
        path = url.removeprefix("file://")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shard index {path} does not exist{_relative(path)}")
        with open(path, "rb") as file:
            data = file.read(INDEX_LIMIT + 1)
    else:
        raise ValueError(f"shard index {url!r}: unsupported scheme {scheme!r}; use a path, http(s)://, s3:// or gs://")
    if len(data) > INDEX_LIMIT:
        raise ValueError(f"{url} is over {INDEX_LIMIT >> 20} MiB: not a shard index; {INDEX_HINT}")
    return data


def _beside(index: str, name: str) -> str:
    """The URL or path of the file `name` in the folder of `index`."""
    if index.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(index)  # the index's query (a signature) is its own, not the shard's
        folder = parts.path[: parts.path.rfind("/") + 1]
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, folder + urllib.parse.quote(name), "", ""))
    if "://" in index and not index.startswith("file://"):
        return index[: index.rfind("/") + 1] + name
    return os.path.join(os.path.dirname(index.removeprefix("file://")), name)


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
            f"`mpp shards write folder {folder} --out shards/<name> --holdout 0.1` and give those"
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
