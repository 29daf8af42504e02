"""Typed, frozen, layered configuration shared by every service.

Each service declares a frozen dataclass (e.g. `services/engine/config.py`). Each field may carry
`help` in its metadata. `add_arguments` turns the dataclass into argparse flags and
`from_layers` fills it: a flag given on the command line wins, then `SLUICE_<FIELD>` from the
environment (read through `env.py`), then the field's default. Values are converted to the
field's type and the class's `__post_init__` validates once. `describe` prints it at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from services.common import env
from services.common.errors import InvalidArgumentError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
# Fields whose name has one of these words (split on "_") are masked in `describe`.
_SECRET_WORDS = frozenset({"password", "secret", "key", "keys", "token", "pepper", "credentials"})
_FALSE = {"0", "false", "no", "off"}


def field(default: Any = dataclasses.MISSING, *, help: str, **kwargs: Any) -> Any:  # noqa: A002
    """A dataclass field with a help text for its flag."""
    metadata = {"help": help}
    if "default_factory" in kwargs:
        return dataclasses.field(default_factory=kwargs.pop("default_factory"), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` flag per field; defaults stay None so layering can see what was given."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        base = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        text = f.metadata.get("help", "")
        text = f"{text} (env SLUICE_{f.name.upper()}; default: {default!r})"
        if base is bool:
            parser.add_argument(
                flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=text
            )
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=text, metavar=f.name.upper())


def from_layers(cls: type[T], flags: Mapping[str, Any] | argparse.Namespace | None = None) -> T:
    """Build `cls` from flags, then SLUICE_* environment variables, then defaults."""
    if isinstance(flags, argparse.Namespace):
        flags = vars(flags)
    flags = dict(flags or {})
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = flags.get(f.name)
        source = "flag"
        if raw is None:
            raw = env.setting(f.name)
            source = "environment"
        if raw is None:
            continue
        values[f.name] = _convert(raw, hints[f.name], f"{f.name} ({source})")
    return cls(**values)


def describe(config: Any) -> str:
    """One line per field, for the start-up log. Fields named like secrets are masked."""
    lines = [f"{type(config).__name__}:"]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _SECRET_WORDS.intersection(f.name.lower().split("_")) and value:
            value = "***"
        lines.append(f"  {f.name} = {value!r}")
    return "\n".join(lines)


def bool_setting(name: str, default: bool) -> bool:
    """SLUICE_<NAME> as a boolean (1/true/yes/on, 0/false/no/off), `default` when unset; any
    other value is refused as a flag's would be."""
    raw = env.setting(name)
    return default if raw is None else _convert(raw, bool, f"{env.PREFIX}{name.upper()}")


def _base_type(hint: Any) -> Any:
    """Strip Optional[...] / X | None to X."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _convert(raw: Any, hint: Any, name: str) -> Any:
    base = _base_type(hint)
    if not isinstance(raw, str):
        return raw
    try:
        if base is bool:
            lowered = raw.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(raw)
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
        if typing.get_origin(base) is tuple:
            inner = typing.get_args(base)[0] if typing.get_args(base) else str
            items = [item.strip() for item in raw.split(",") if item.strip()]
            return tuple(inner(item) for item in items)
        return raw
    except ValueError as exc:
        raise InvalidArgumentError(f"{name}: cannot read {raw!r} as {base}") from exc
