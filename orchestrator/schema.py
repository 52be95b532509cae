"""Strict conversion of YAML data into frozen dataclasses.

Every field is typed; unknown keys are errors (a typo must never fall back to a
default); errors name the file, the key path and what was expected.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from .errors import InputError
from .secrets import is_secret_name


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (tuple, list):
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any, path: str) -> str:
    """The wrong value, for the error message; not under a secret-named key (engine.env.HF_TOKEN)."""
    return "a value (not shown: the key names a secret)" if is_secret_name(path.rsplit(".", 1)[-1]) else repr(value)


def convert(tp: Any, value: Any, path: str, file: str) -> Any:
    """Convert `value` to type `tp`, raising InputError naming file and key path."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in get_args(tp):
            raise InputError(f"expected {_type_name(tp)}, got {_got(value, path)}", file=file, key=path)
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            # Optional[X]: X's own error (e.g. an unknown key deep inside) is the useful one.
            return convert(arms[0], value, path, file)
        for a in arms:
            try:
                return convert(a, value, path, file)
            except InputError:
                continue
        raise InputError(f"expected {_type_name(tp)}, got {_got(value, path)}", file=file, key=path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path, file)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise InputError(f"expected {_type_name(tp)}, got {_got(value, path)}", file=file, key=path)
        (item,) = get_args(tp)[:1] or (Any,)
        return tuple(convert(item, v, f"{path}[{i}]", file) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise InputError(f"expected a mapping, got {_got(value, path)}", file=file, key=path)
        kt, vt = get_args(tp) or (Any, Any)
        return {convert(kt, k, f"{path}.{k}", file): convert(vt, v, f"{path}.{k}", file)
                for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise InputError(f"expected true or false, got {_got(value, path)}", file=file, key=path)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"expected an integer, got {_got(value, path)}", file=file, key=path)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"expected a number, got {_got(value, path)}", file=file, key=path)
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise InputError(f"expected a string, got {_got(value, path)}", file=file, key=path)
        return str(value)
    raise TypeError(f"schema: unsupported type {tp!r} at {path}")


def from_dict(cls: type, data: Any, path: str, file: str) -> Any:
    """Build dataclass `cls` from mapping `data`; unknown keys and missing keys are errors."""
    if not isinstance(data, dict):
        raise InputError(f"expected a mapping, got {_got(data, path)}", file=file, key=path or "(top level)")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise InputError(f"unknown key {unknown[0]!r} (known keys here: {known})",
                         file=file, key=_join(path, unknown[0]))
    kwargs = {}
    for name, f in fields.items():
        key = _join(path, name)
        if name in data:
            kwargs[name] = convert(hints[name], data[name], key, file)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InputError(f"missing required key (expected {_type_name(hints[name])})",
                             file=file, key=key)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check:
        check(path, file)
    return obj


def from_yaml(cls: type, data: dict, lines: dict[str, int], file: str) -> Any:
    """from_dict for data loaded from a YAML file: errors point at the offending key's line."""
    try:
        return from_dict(cls, data, "", file)
    except InputError as e:
        raise at_line(e, lines) from None


def at_line(e: InputError, lines: dict[str, int]) -> InputError:
    """E with the line of its key in the file (`lines` from yamlfile), when it has none yet."""
    line = lines.get(e.key or "") if e.key else None
    if line and e.line is None:
        return InputError(e.detail, file=e.file, key=e.key, line=line)
    return e


def to_dict(obj: Any) -> Any:
    """Plain data (for JSON and digests) from dataclasses, tuples and dicts."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
