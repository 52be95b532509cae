"""Memory budget per node (placeholder: the sizing issue fills this in)."""
from __future__ import annotations

from typing import Any


def plan_extra(dep) -> dict[str, Any]:
    return {}
