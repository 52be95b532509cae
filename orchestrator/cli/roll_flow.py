"""`up -d NAME` of a deployment with replicas (#58): each replica's own `up`, one at a time, stopping at
the first that fails (orchestrator/rolling.py says what happens within one; docs/deployments.md)."""
from __future__ import annotations

from typing import Any

from ..errors import DeployctlError
from ..inventory import InventoryRef, deployment_names, replica_names
from ..rolling import roll_order
from .common import STDERR


def replicas_to_roll(inventory: Any) -> tuple[str, list[str]] | None:
    """(the replicated deployment, its replicas) when `up` is asked for one: -d NAME of a deployment with
    replicas, or no -d on an inventory whose only deployment has replicas; else None (an ordinary up)."""
    name = getattr(inventory, "deployment", None)
    if name:
        reps = replica_names(inventory, name)
        return (name, reps) if reps else None
    names = deployment_names(inventory)
    bases = {n.rsplit(".r", 1)[0] for n in names if ".r" in n and n.rsplit(".r", 1)[1].isdigit()}
    if len(names) > 1 and len(bases) == 1 and replica_names(inventory, next(iter(bases))) == names:
        return next(iter(bases)), names
    return None


def roll(inventory: Any, base: str, names: list[str], **up: Any) -> int:
    """Run `up` (cli/pipeline.run_stages with UP's arguments, --rollback-on-failure on) of each replica in
    roll order; the exit code: 0, or the first failed replica's (the rest are not touched)."""
    from .pipeline import run_stages
    order = roll_order(names)
    for i, name in enumerate(order, 1):
        STDERR.print(f"roll {base}: replica {i} of {len(order)}: {name}", markup=False, highlight=False)
        try:
            run_stages(command="up", inventory=InventoryRef.of(inventory, name), rollback_on_failure=True, **up)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except DeployctlError as e:
            STDERR.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
            code = e.exit_code
        if code != 0:
            rest = order[i:]
            why = ("its input was refused before any host was touched (above)" if code == 2 else
                   "it failed its `up` (its previous release brought back when the new one failed launch or health: above)")
            STDERR.print(f"error: the roll of {base} stopped at replica {name} (exit {code}): {why}; "
                         + (f"not changed: {', '.join(rest)} (still on their release)" if rest else "it was the last"),
                         markup=False, highlight=False, soft_wrap=True)
            return code
    STDERR.print(f"roll {base}: ok ({len(order)} replicas, one at a time)", markup=False, highlight=False)
    return 0
