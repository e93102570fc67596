"""Command-line flags for the engine, generated from EngineConfig's fields (see `kvops.engine.config`).

Torch-free: `kvops run/top/doctor` build the whole CLI parser, engine flags included, at start.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Mapping
from dataclasses import Field, fields
from typing import Any

from kvops.engine.config import EngineConfig, flag_name

# Every engine setting by name, in field order: the keys of a supervisor's `[engines.args]`.
ENGINE_SETTINGS = tuple(each.name for each in fields(EngineConfig))


def _flag_type(annotation: Any) -> Callable[[str], Any] | None:
    """int for an int (or optional int) field; other values stay strings, which the config parses
    (sizes like 512MiB, layer lists like 0,5)."""
    members = set(typing.get_args(annotation) or (annotation,)) - {type(None)}
    return int if members == {int} else None


def _flag_options(each: Field[Any], annotation: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"default": each.default, "help": each.metadata["help"]}
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction  # --enable-prefix-caching / --no-enable-prefix-caching
    elif (convert := _flag_type(annotation)) is not None:
        options["type"] = convert
    for key in ("choices", "metavar"):
        if each.metadata[key] is not None:
            options[key] = each.metadata[key]
    return options


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named, typed and documented by the field."""
    group = parser.add_argument_group("engine")
    annotations = typing.get_type_hints(EngineConfig)
    for each in fields(EngineConfig):
        group.add_argument(flag_name(each.name), **_flag_options(each, annotations[each.name]))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in ENGINE_SETTINGS})


def engine_flags(settings: Mapping[str, Any]) -> list[str]:
    """The flags that give these settings to `kvops engine serve` (a supervisor's `[engines.args]`,
    a restart fix's new settings): the inverse of `add_engine_args`. None leaves a setting at its default;
    the supervisor's config has already checked the names against ENGINE_SETTINGS."""
    flags: list[str] = []
    for name, value in settings.items():
        flag = flag_name(name)
        if isinstance(value, bool):
            flags.append(flag if value else flag.replace("--", "--no-", 1))
        elif isinstance(value, list | tuple):
            flags += [flag, ",".join(str(v) for v in value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
