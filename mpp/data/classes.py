"""The classes of a labelled shard set, as its index (the sidecar mpp writes beside its shards) lists
them, and a classifier config completed from them."""

from __future__ import annotations

from typing import Any

import braceexpand

from mpp.data.module import ShardSpec
from mpp.data.urls import expand_urls, index_classes, is_index
from mpp.errors import ConfigError
from mpp.secrets import redact
from mpp.shards.format import ShardError
from mpp.shards.inspector import listed_classes


def listed_classes_of(spec: ShardSpec, *, allow_pipe: bool = False) -> tuple[list[str], str] | None:
    """The class names the shard index of a split lists, and where: an index the split names (a path or
    a URL), or the index beside local shards named like mpp's; None where none lists them. Indexes that
    list other classes are an error naming both."""
    items = [spec] if isinstance(spec, str) else list(spec)
    try:
        named = [url for item in items for url in braceexpand.braceexpand(item) if is_index(url)]
        found = [(classes, url) for url in named if (classes := index_classes(url)) is not None]
        beside = listed_classes(expand_urls(spec, allow_pipe=allow_pipe))
    except (OSError, ValueError, ShardError) as error:
        raise ConfigError(redact(str(error))) from error
    found += [] if beside is None else [(beside[0], str(beside[1][0]))]
    if not found:
        return None
    (classes, where), *others = found
    for other, elsewhere in others:
        if other != classes:
            raise ConfigError(
                redact(f"{where} lists classes {classes} and {elsewhere} lists {other}: name shards of one labelling")
            )
    return classes, where


def fill_classes(config: Any, subcommand: str | None) -> list[str]:
    """A classifier's `num_classes` and `class_names`, where the config sets neither, from the index of
    the shards the subcommand reads (train for fit, val for validate, test for test); the line that
    says so. A config that names other classes than the index is refused, naming both."""
    init = getattr(config.model, "init_args", None)
    split = {"fit": "train", "validate": "val", "test": "test"}.get(subcommand or "fit")  # none: built to fit
    spec = None if split is None else config.data.get(split)
    if init is None or "num_classes" not in init or spec is None:
        return []
    number, names = init.num_classes, init.class_names
    try:
        listed = listed_classes_of(spec, allow_pipe=bool(config.data.get("allow_pipe")))
    except ConfigError as error:  # shards that are not there: the data module's checks say so, unless needed now
        if number is None and names is None:
            raise ConfigError(f"data.{split}: {error}") from error
        return []
    if listed is None:
        return []
    classes, index = listed
    if number is None and names is None:
        init.num_classes, init.class_names = len(classes), list(classes)
        return [f"mpp: {len(classes)} classes from {index}: {', '.join(classes)}"]
    if (number is not None and number != len(classes)) or (names is not None and list(names) != classes):
        raise ConfigError(
            f"model.init_args.num_classes={number} and class_names={names} are not the {len(classes)} classes "
            f"{index} lists ({', '.join(classes)}): set both to null to take the index's, or name shards of "
            f"these classes in data.{split}"
        )
    init.num_classes, init.class_names = len(classes), list(classes)
    return []
