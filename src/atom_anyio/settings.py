"""Settings as dataclass fields: each has a help line, and is both an ``ATOM_<NAME>`` variable
and a ``serve --<name>`` flag. ``setting()`` declares one; ``parse_setting`` reads one from text."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A bad setting: the message names it, its value and what is allowed (one line, no traceback)."""


def setting(
    default: Any = None,
    help: str = "",
    *,
    parse: Callable[[str], Any] | None = None,
    name: str = "",
    repr: bool = True,
) -> Any:
    """A dataclass field that is a setting. ``parse``: text -> value (default: from the annotation);
    ``name``: the variable and flag name when it differs from the field's."""
    metadata = {"help": help, "parse": parse, "name": name}
    if isinstance(default, dict | list):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata, repr=repr)
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


def settings_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def setting_name(f: dataclasses.Field) -> str:
    return f.metadata.get("name") or f.name


def parser_of(cls: type, f: dataclasses.Field) -> Callable[[str], Any]:
    return f.metadata.get("parse") or _parser(typing.get_type_hints(cls)[f.name])


def parse_setting(cls: type, f: dataclasses.Field, raw: str, source: str) -> Any:
    """``raw`` as the field's type; ``source`` names where it came from (``ATOM_X=...`` or ``--x``)."""
    parse = parser_of(cls, f)
    try:
        return parse(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {_reason(exc, parse)}") from None


def _parser(hint: Any) -> Callable[[str], Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kind = typing.get_origin(hint) or hint
    if kind is bool:
        return _bool
    if kind is dict:
        return json_object
    if kind in (int, float):
        return kind
    return str


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")


def json_object(raw: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _reason(exc: Exception, parse: Callable) -> str:
    if parse is int:
        return "not an integer"
    if parse is float:
        return "not a number"
    return str(exc)
