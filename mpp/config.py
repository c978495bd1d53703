"""Config files as mpp reads them: YAML, omegaconf's ${...} interpolation, and `__base__`.

A mapping's `__base__: <file>` (or a list of files) is read first and the mapping's own keys
override it, which is how a run config names its encoder's size preset and adds its own keys:

    encoder:
      __base__: ../model/vit_b.yaml
      image_size: 224
      patch_size: 16

jsonargparse has no such key of its own (a file named as a value replaces the whole mapping).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import get_loader, set_loader
from omegaconf import OmegaConf

from mpp.errors import ConfigError
from mpp.moved import current_class_paths

PARSER_MODE = "mpp"  # jsonargparse's name for this way of reading configs
BASE_KEY = "__base__"


def load_config(text: str) -> Any:
    """A config's text -> its value, as parser mode "omegaconf" reads it, `__base__` files merged in
    and class paths of earlier layouts made today's (mpp.moved); a `__base__` path is relative to the
    config that names it (jsonargparse reads a config from inside its folder, so relative to the
    working folder here)."""
    return current_class_paths(resolved(get_loader("yaml")(text), os.getcwd(), ()))


def read_config(path: str | os.PathLike) -> Any:
    """A config file as `mpp` reads it, `__base__` files merged in: for tools that read a run config."""
    path = os.path.abspath(path)
    return resolved(get_loader("yaml")(Path(path).read_text()), os.path.dirname(path), (path,))


def resolved(value: Any, folder: str, chain: tuple[str, ...]) -> Any:
    """A loaded config with its `__base__` files merged in and its ${...} interpolations resolved."""
    if not isinstance(value, (dict, list)):
        return value
    return OmegaConf.to_object(OmegaConf.create(with_bases(value, folder, chain)))


def with_bases(value: Any, folder: str, chain: tuple[str, ...]) -> Any:
    """`value` with the `__base__` files of its mappings (relative to `folder`) merged under their keys."""
    if isinstance(value, list):
        return [with_bases(item, folder, chain) for item in value]
    if not isinstance(value, dict):
        return value
    value = dict(value)
    bases = value.pop(BASE_KEY, [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(base, str) for base in bases):
        raise ConfigError(f"{BASE_KEY} must name a config file or a list of them, got {bases!r}")
    merged: dict = {}
    for base in bases:
        path = os.path.normpath(os.path.join(folder, os.path.expanduser(base)))
        if path in chain:
            raise ConfigError(f"{BASE_KEY} files name each other in a loop: {' -> '.join((*chain, path))}")
        try:
            loaded = get_loader("yaml")(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"{BASE_KEY}: cannot read {base} ({path}): {error.strerror}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{BASE_KEY}: {path} holds no mapping of keys")
        merged = merged_over(merged, with_bases(loaded, os.path.dirname(path), (*chain, path)))
    return merged_over(merged, {key: with_bases(item, folder, chain) for key, item in value.items()})


def merged_over(base: dict, override: dict) -> dict:
    """`override`'s keys laid over `base`'s, mappings merged key by key."""
    merged = dict(base)
    for key, item in override.items():
        both = isinstance(item, dict) and isinstance(merged.get(key), dict)
        merged[key] = merged_over(merged[key], item) if both else item
    return merged


def register_parser_mode() -> str:
    """Teach jsonargparse to read configs with load_config -> the parser mode's name."""
    set_loader(PARSER_MODE, load_config, (yaml.YAMLError,))
    return PARSER_MODE
