"""Options shared by the commands, error-to-exit-code mapping, and the stage runner glue."""
from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import click
from rich.console import Console

from ..errors import DeployctlError
from ..executors.ssh_pool import shared_connections
from ..errors import InputError
from ..inventory import InventoryRef, deployment_names, replica_names
from ..secrets import mask_data, mask_text


class MaskingConsole(Console):
    """A Console whose printed strings are masked (secrets.py): no error or failure message deployctl
    prints can show a secret, wherever the text came from (a host's stderr, an exception)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*(mask_text(o) if isinstance(o, str) else o for o in objects), **kwargs)


STDERR = MaskingConsole(stderr=True, highlight=False, soft_wrap=True)   # long paths stay on one line


def inventory_option(f: Callable) -> Callable:
    """-i INVENTORY and -d DEPLOYMENT (one of the inventory's all.vars.deployments): the command gets one
    `inventory` value, an InventoryRef carrying the name when one is given."""
    @functools.wraps(f)
    def with_deployment(*args: Any, deployment_name: str | None = None, **kwargs: Any) -> Any:
        if deployment_name:
            kwargs["inventory"] = InventoryRef.of(kwargs.get("inventory"), deployment_name)
        return f(*args, **kwargs)
    g = click.option("--deployment", "-d", "deployment_name", envvar="DEPLOYCTL_DEPLOYMENT", show_envvar=True,
                     default=None, help="Which of the inventory's deployments (all.vars.deployments); "
                                        "needed when it holds several.")(with_deployment)
    return click.option("--inventory", "-i", "inventory", type=click.Path(dir_okay=False),
                        envvar="DEPLOYCTL_INVENTORY", show_envvar=True,
                        help="Ansible YAML inventory (default: inventories/local4.yml, the local "
                             "test cluster).")(g)


def recipe_options(f: Callable) -> Callable:
    f = click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE",
                     help="Override a recipe field, e.g. --set engram.placement=memory (repeatable).")(f)
    f = click.option("--recipe", "-r", default=None,
                     help="Recipe name in recipes/ or a path (default: the one the inventory names).")(f)
    return f


def every_deployment(inventory: Any, **one_only: Any) -> list[str] | None:
    """The inventory's deployments when the command names none and it holds several (the command then
    acts on each), else None. ONE_ONLY: the options given that act on one deployment (name=value):
    with several and no --deployment, any of them set is refused, naming them. --deployment NAME of a
    deployment with replicas (inventory.py expand_replicas): its replicas, NAME.r1 ...."""
    if (reps := replica_names(inventory, getattr(inventory, "deployment", None))) is not None:
        names = reps
    elif getattr(inventory, "deployment", None) or len(names := deployment_names(inventory)) < 2:
        return None
    given = [f"--{k.replace('_', '-')}" for k, v in one_only.items() if v]
    if given:
        raise InputError(f"{', '.join(given)} {'act' if len(given) > 1 else 'acts'} on one deployment: add "
                         f"--deployment NAME",
                         file=str(inventory or ""), key="all.vars.deployments")
    return names


def output_options(f: Callable) -> Callable:
    f = click.option("--json", "as_json", is_flag=True, help="Print a JSON document on stdout.")(f)
    f = click.option("-v", "--verbose", count=True, help="More output (stream host logs).")(f)
    f = click.option("-q", "--quiet", is_flag=True, help="Only errors.")(f)
    return f


def deployment_options(f: Callable) -> Callable:
    return inventory_option(recipe_options(output_options(f)))


def handle_errors(f: Callable) -> Callable:
    """DeployctlError -> message on stderr and its exit code (2 bad input, 1 failure).
    The command runs in one shared-connection scope: one SSH connection per host (executors/ssh_pool.py)."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with shared_connections():
                return f(*args, **kwargs)
        except DeployctlError as e:
            STDERR.print(f"[red]error:[/red] {e}", markup=True, highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
    return wrapper


def emit_json(doc: Any) -> None:
    """Every --json document (plans, dry runs, status, outcomes), masked like the run records."""
    click.echo(json.dumps(mask_data(doc), indent=2, default=str))
