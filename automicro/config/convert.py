"""Typed conversion of a plain tree (what YAML / omegaconf yields) onto the config dataclasses.

Owns: `ConfigError` and the generic, schema-agnostic conversion -- `_build(cls, value, key)` walks
any dataclass field by field (unknown keys with a "did you mean", per-field ``parse`` / ``choices``
/ ``check`` metadata, then the instance's ``_cross_check``), `_check_type` converts one value to
a type hint without coercion (except int -> float) and every error names the dotted key, the bad
value and what is allowed. May not touch: the schema's own classes (it knows only the metadata
convention), YAML / omegaconf, files, Composer, the trainer.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Sequence, Union


class ConfigError(ValueError):
    """A bad configuration; the message names the dotted key, the bad value and what is allowed."""


def _did_you_mean(name: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_optional(tp: Any) -> tuple[bool, Any]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args:
            rest = tuple(a for a in args if a is not type(None))
            return True, rest[0] if len(rest) == 1 else Union[rest]
    return False, tp


def _describe(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if optional:
        return f"{_describe(inner)} or null"
    origin = typing.get_origin(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an int"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if origin in (list, Sequence) or tp is list:
        args = typing.get_args(tp)
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    return {str: "strings", int: "ints", float: "numbers", bool: "booleans"}.get(tp, _describe(tp))


class _TypeMismatch(Exception):
    pass


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` to ``tp`` without coercion (except int -> float); ConfigError otherwise."""
    try:
        return _convert(value, tp, key)
    except _TypeMismatch:
        note = ""
        if isinstance(value, bool) and tp in (int, float):
            note = " (true/false is not a number)"
        elif isinstance(value, float) and tp is int:
            note = " (no fractional values)"
        raise ConfigError(f"{key}={value!r}: must be {_describe(tp)}{note}") from None


def _convert(value: Any, tp: Any, key: str) -> Any:
    if tp is Any:
        return value
    optional, inner = _is_optional(tp)
    if optional:
        return None if value is None else _convert(value, inner, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _TypeMismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _TypeMismatch
    origin = typing.get_origin(tp)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _TypeMismatch
        args = typing.get_args(tp)
        if not args:
            return list(value)
        return [_check_type(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _TypeMismatch
        args = typing.get_args(tp)
        vt = args[1] if args else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}.{k}={v!r}: keys must be strings")
            out[k] = _check_type(v, vt, f"{key}.{k}")
        return out
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _convert(value, arm, key)
            except (_TypeMismatch, ConfigError):
                continue
        raise _TypeMismatch
    raise TypeError(f"automicro.config: unsupported field type {tp!r} at {key}")  # programming error


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, value: Any, key: str) -> Any:
    """Build dataclass ``cls`` from mapping ``value`` found at dotted ``key`` ("" = top level)."""
    where = key or "top level"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key or 'config'}={value!r}: must be a mapping of {cls.__name__} settings")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{key}." if key else ""
    fold = getattr(cls, "_fold_extra", None)
    if fold is not None:
        value = fold(value, prefix)
    for k, v in value.items():
        if k not in fields:
            raise ConfigError(
                f"{prefix}{k}={v!r}: unknown key{_did_you_mean(str(k), fields)}; "
                f"allowed keys at {where}: {', '.join(fields)}"
            )
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in value:
            continue
        raw = value[name]
        fkey = f"{prefix}{name}"
        parse = f.metadata.get("parse")
        v = parse(raw, fkey) if parse is not None else _check_type(raw, hints[name], fkey)
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ConfigError(
                f"{fkey}={raw!r}: must be one of {', '.join(map(str, choices))}{_did_you_mean(str(raw), choices)}"
            )
        check = f.metadata.get("check")
        if check is not None and v is not None:
            problem = check(v)
            if problem:
                raise ConfigError(f"{fkey}={raw!r}: {problem}")
        kwargs[name] = v
    obj = cls(**kwargs)
    cross = getattr(obj, "_cross_check", None)
    if cross is not None:
        cross(prefix)
    return obj
