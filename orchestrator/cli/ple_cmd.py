"""deployctl ple: Qwen's memory-mapped n-gram ("PLE") table file.

  deployctl ple -i INV [--verify]       stage write-ple on the inventory's hosts, through Ansible
  deployctl ple write --checkpoint DIR --dest DIR [-r RECIPE] [--set ...] [--verify] [--json]
                                        the same operation on this machine (what a host runs)
  deployctl ple vars -i INV             the variables for running playbooks/write-ple.yml by hand
  deployctl ple spec [-r RECIPE]        the JSON spec the host-side op reads
"""
from __future__ import annotations

import json
import socket

import click

from ..recipe import load_recipe
from ..runoptions import RunOptions
from .common import deployment_options, emit_json, handle_errors, recipe_options
from .pipeline import run_stages

DEFAULT_RECIPE = "qwen38-flash-next-spark"


@click.group("ple", invoke_without_command=True)
@deployment_options
@click.option("--verify", is_flag=True, help="Re-hash a kept table file against its manifest.")
@click.pass_context
@handle_errors
def ple_group(ctx, inventory, recipe, sets, as_json, verbose, quiet, verify):
    """Write Qwen's memory-mapped PLE table file on the target host (pipeline stage write-ple).

    A file still valid for the same checkpoint and geometry is kept once proven (docs/table-proof.md).
    `deployctl ple write` is the same operation on this machine.
    """
    if ctx.invoked_subcommand is None:
        run_stages(command="ple", inventory=inventory, recipe=recipe, sets=tuple(sets),
                   only=("write-ple",), as_json=as_json, verbose=verbose, quiet=quiet,
                   options=RunOptions(verify=verify))


def _spec(recipe: str | None, sets: tuple[str, ...]) -> dict:
    from ..errors import InputError
    from ..stages.write_ple import spec_for
    loaded = load_recipe(recipe or DEFAULT_RECIPE, sets)
    if loaded.recipe.ple is None:
        raise InputError(f"recipe {loaded.recipe.name} has no ple section (no PLE table)",
                         file=str(loaded.path), key="ple")
    return spec_for(loaded.recipe)


@ple_group.command("write")
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="Checkpoint folder (safetensors + index).")
@click.option("--dest", required=True, type=click.Path(file_okay=False),
              help="Folder for the table file (SGLang's --ple-offload-dir).")
@recipe_options
@click.option("--verify", is_flag=True, help="Re-hash a kept table file against its manifest "
              "(a mismatch rewrites it).")
@click.option("--no-preallocate", is_flag=True, help="Skip fallocate (filesystems without it).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@handle_errors
def write_command(checkpoint, dest, recipe, sets, verify, no_preallocate, as_json):
    """Write (or keep) the PLE table file from a local checkpoint (default recipe: qwen38-flash-next-spark).

    Exit 0 written or kept, 1 failed (I/O, space, read-back), 2 bad input (missing shard,
    wrong width, row total different from the geometry's).
    """
    from ..hostside.ple_spec import parse_spec
    from ..hostside.ple_write import write_table
    spec = parse_spec(_spec(recipe, tuple(sets)), f"recipe {recipe or DEFAULT_RECIPE}")
    out = write_table(spec, checkpoint, dest, verify=verify, host=socket.gethostname(),
                      prealloc=not no_preallocate, quiet=as_json)
    doc = out.to_json()
    if as_json:
        emit_json(doc)
        return
    if out.status in ("written", "rewritten"):
        click.echo(f"{out.status} {doc['file']}: {doc['bytes'] / 1e9:.2f} GB in {doc['seconds']} s "
                   f"({doc['mb_per_s']} MB/s), {doc['readback_rows']} rows read back; {out.reason}")
    elif out.status == "kept":
        click.echo(f"kept {doc['file']} (decided in {doc['decided_in_s']} s): {out.reason}")
    else:
        click.echo(out.reason)
    if doc.get("removed"):
        click.echo(f"removed: {', '.join(doc['removed'])}")


@ple_group.command("vars")
@deployment_options
@click.option("--pyz", type=click.Path(dir_okay=False), default=None,
              help="A zipapp built before (default: build it into ./.deployctl/).")
@click.option("--verify", is_flag=True)
@handle_errors
def vars_command(inventory, recipe, sets, as_json, verbose, quiet, pyz, verify):
    """Print the -e @vars.json for `ansible-playbook -i INV playbooks/write-ple.yml`."""
    from ..deployment import load_deployment
    from ..stages.write_ple import playbook_vars
    from ..hostside import bundle
    dep = load_deployment(inventory, recipe, tuple(sets))
    if dep.recipe.ple is None:
        from ..errors import InputError
        raise InputError(f"recipe {dep.recipe.name} has no ple section", key="ple")
    pyz = pyz or str(bundle.build(".deployctl"))
    click.echo(json.dumps(playbook_vars(dep, pyz, verify=verify), indent=2))


@ple_group.command("spec")
@recipe_options
@handle_errors
def spec_command(recipe, sets):
    """Print the JSON spec `python3 deployctl-tables-*.pyz ple-write --spec` reads."""
    click.echo(json.dumps(_spec(recipe, tuple(sets)), indent=2))
