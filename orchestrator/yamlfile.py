"""YAML loading that keeps line numbers, so errors can point at the line."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import InputError

# libyaml's loader when PyYAML was built with it (the wheels are): the same documents, 5-10x faster,
# which a run's recipes, chains and inventory notice. The pure-Python one otherwise.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Loaded(dict):
    """A mapping loaded from a file, with `lines[key.path] = line number`."""

    file: str
    lines: dict[str, int]


def load(path: str | Path) -> Loaded:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InputError("file not found", file=str(p)) from None
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", file=str(p)) from None
    return loads(text, str(p))


def loads(text: str, file: str) -> Loaded:
    try:
        node = yaml.compose(text, Loader=SafeLoader)
        data = yaml.load(text, Loader=SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise InputError(f"malformed YAML: {e.problem or e}", file=file, line=line) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError("expected a mapping at the top level", file=file)
    out = Loaded(data)
    out.file = file
    out.lines = {}
    if node is not None:
        _walk(node, "", out.lines)
    return out


def _walk(node: Any, path: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{path}.{k.value}" if path else str(k.value)
            lines[key] = k.start_mark.line + 1
            _walk(v, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            key = f"{path}[{i}]"
            lines[key] = v.start_mark.line + 1
            _walk(v, key, lines)
