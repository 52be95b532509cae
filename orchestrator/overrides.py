"""Recipe overrides (`--set key.path=value`, an inventory's recipe_overrides) and where each came from.

An override changes the recipe's data before it is checked, so a bad value fails the recipe's own
checks; but the value was not written in the recipe file. `apply` remembers which override set
(or created) each key path, and `blame` moves an error on such a key to the override's own source:
`--set: engine.port` or `<inventory>:<line>: all.vars.recipe_overrides.engine.port`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable

import yaml

from .errors import InputError


@dataclass(frozen=True)
class Override:
    expr: str                         # key.path=value (the value is YAML)
    file: str | None = None           # the inventory it came from; None: the command line (--set)
    key: str | None = None            # its key there, e.g. all.vars.recipe_overrides.engine.port
    line: int | None = None

    @property
    def path(self) -> str:
        return self.expr.partition("=")[0].strip()

    def error(self, detail: str, rest: str = "") -> InputError:
        """An error on this override's value (or on REST below its key path)."""
        if self.file is None:             # "--set: engine.port: ...": the source, then the key path
            return InputError(detail, file="--set", key=f"{self.path}{rest}")
        return InputError(detail, file=self.file, key=f"{self.key}{rest}", line=self.line)


def as_override(o: "Override | str") -> Override:
    return o if isinstance(o, Override) else Override(o)


def parse_set(expr: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], parsed YAML value)."""
    if "=" not in expr:
        raise InputError(f"expected key.path=value, got {expr!r}", file="--set")
    key, _, raw = expr.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise InputError(f"empty key path in {expr!r}", file="--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply(data: dict, overrides: Iterable["Override | str"]) -> tuple[dict, dict[str, Override]]:
    """Apply the overrides in order to a copy of raw recipe data. Returns it and, for every key path
    an override set or created, that override (a later one wins, as its value does).

    The key path must already exist in the recipe or be a field of the schema (checked when the
    result is converted); mappings such as engine.args and engine.env may receive new keys.
    """
    out = copy.deepcopy(data)
    origins: dict[str, Override] = {}
    for o in map(as_override, overrides):
        try:
            parts, value = parse_set(o.expr)
        except InputError as e:
            raise (o.error(e.detail) if o.file else e) from None
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
                origins[".".join(parts[:i + 1])] = o
            if not isinstance(nxt, dict):
                raise o.error(f"{'.'.join(parts[:i + 1])} is not a mapping, so {o.path} cannot be set")
            node = nxt
        node[parts[-1]] = value
        path = ".".join(parts)
        for below in [k for k in origins if k.startswith((path + ".", path + "["))]:
            del origins[below]                                  # replaced along with its parent
        origins[path] = o
    return out, origins


def origin_of(origins: dict[str, Override], path: str) -> Override | None:
    """The override that set PATH's value (PATH itself or a mapping above it); None: the recipe file's."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        o = origins.get(".".join(parts[:i]))
        if o is not None:
            return o
    return None


def precedence(o: Override | None) -> int:
    """Where a value came from, least specific first: 0 the recipe file, 1 an inventory's
    recipe_overrides, 2 the command line (--set); later ones override earlier ones."""
    return 0 if o is None else 2 if o.file is None else 1


def where(o: Override | None, recipe_file: str = "the recipe") -> str:
    """The source of a value in words, for a message."""
    if o is None:
        return recipe_file
    if o.file is None:
        return f"--set {o.expr}"
    return f"{o.file}{f':{o.line}' if o.line else ''}: {o.key}"


def blame(e: InputError, origins: dict[str, Override]) -> InputError | None:
    """The error moved to the override that set E's key (or a mapping above it); None if none did."""
    if not e.key:
        return None
    for path in sorted(origins, key=len, reverse=True):          # the most specific override first
        if e.key == path or e.key.startswith((path + ".", path + "[")):
            return origins[path].error(e.detail, e.key[len(path):])
    return None
