"""Secrets never reach logs, plans or run records.

A value is secret when its variable name looks like one (HF_TOKEN, *_SECRET,
*_PASSWORD, *_API_KEY ...). Masking replaces both the value in a mapping and
any occurrence of a known secret value inside free text.
"""
from __future__ import annotations

import os
import re
from typing import Any

MASK = "***"
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY)", re.I)


def is_secret_name(name: str) -> bool:
    # A *_FILE / *_PATH variable names where a secret lives, not the secret itself.
    if name.upper().endswith(("_FILE", "_PATH", "_DIR")):
        return False
    return bool(_SECRET_NAME.search(name))


_REGISTERED: set[str] = set()      # secrets read from files (the serving API key, orchestrator/apikey.py)


def register_secret(value: str) -> None:
    """A secret deployctl read from somewhere other than the environment: masked like the others."""
    if value:
        _REGISTERED.add(value)


def secret_values(env: dict[str, str] | None = None) -> list[str]:
    """Values of secret-named variables in `env` (default: this process's environment), and the
    registered secrets."""
    env = os.environ if env is None else env
    # Short values would mask ordinary words; real tokens are long.
    found = {v for k, v in env.items() if is_secret_name(k) and v and len(v) >= 6}
    return sorted(found | _REGISTERED, key=len, reverse=True)


_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=([^\s'\"]+)")


def mask_text(text: str, values: list[str] | None = None) -> str:
    """Known secret values anywhere, and `NAME=value` where NAME looks secret (e.g. `-e HF_TOKEN=...`)."""
    for v in secret_values() if values is None else values:
        text = text.replace(v, MASK)
    return _ASSIGNMENT.sub(lambda m: f"{m.group(1)}={MASK}" if is_secret_name(m.group(1)) else m.group(0),
                           text)


def mask_env(env: dict[str, Any]) -> dict[str, Any]:
    return {k: (MASK if is_secret_name(k) and v not in ("", None) else v) for k, v in env.items()}


def mask_data(data: Any, values: list[str] | None = None) -> Any:
    """Mask a JSON-like document: secret-named keys and any secret value in strings."""
    values = secret_values() if values is None else values
    if isinstance(data, dict):
        return {k: (MASK if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) and v
                    else mask_data(v, values)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [mask_data(v, values) for v in data]
    if isinstance(data, str):
        return mask_text(data, values)
    return data


def mask_override(expr: str) -> str:
    """`engine.env.HF_TOKEN=hf_...` -> `engine.env.HF_TOKEN=***`."""
    key, sep, value = expr.partition("=")
    return f"{key}={MASK}" if sep and is_secret_name(key.rsplit(".", 1)[-1]) and value else expr

