"""deployctl build: build the serving image chain on the head node's Docker engine, cached per step."""
from __future__ import annotations

import click

from ..errors import InputError
from ..runoptions import RunOptions
from .common import deployment_options, handle_errors
from .pipeline import run_stages


def _pairs(values: tuple[str, ...], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        if "=" not in v:
            raise InputError(f"{flag} {v!r}: expected NAME=VALUE", key=flag)
        k, _, val = v.partition("=")
        out[k.strip()] = val
    return out


@click.command("build")
@deployment_options
@click.option("--local", is_flag=True,
              help="Build with this machine's Docker engine (DOCKER_HOST or the local socket) instead of "
                   "the head node's engine over SSH.")
@click.option("--ci", is_flag=True,
              help="Non-interactive CI run: report in the run record (build-report.json) and, under "
                   "GitHub Actions, a table in the job summary; non-zero exit on failure. Use with --json.")
@click.option("--update-lock", is_flag=True,
              help="Re-resolve the lock's base tag to a digest first (registry, else the local image's "
                   "RepoDigests, else its image ID) and rewrite the lock file.")
@click.option("--prune", is_flag=True,
              help="After success, remove this chain's stale step images (other digests) and leftovers.")
@click.option("--no-cache", is_flag=True, help="Rebuild every step (ignore deployctl's and the engine's cache).")
@click.option("--inputs-dir", type=click.Path(file_okay=False),
              help="Folder holding the chain's inputs (default: the lock's inputs_dir).")
@click.option("--input-root", "input_roots", multiple=True, metavar="NAME=DIR",
              help="Override a named input root of the lock (repeatable).")
@click.option("--var", "chain_vars", multiple=True, metavar="NAME=VALUE",
              help="Override a chain variable, e.g. --var max_jobs=2 (repeatable).")
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet, local, ci, update_lock, prune, no_cache,
            inputs_dir, input_roots, chain_vars):
    """Build the serving image chain on the head node's Docker engine, cached per step.

    Each step of the recipe's chain (engine.chain, dockerfiles/chains/) is reused when an image with
    its digest exists, else built; the last step's image is tagged engine.image. One line per step
    on the console; -v streams the build output; every step's output is in the run record.
    """
    options = RunOptions(local=local, ci=ci, update_lock=update_lock, prune=prune, no_cache=no_cache,
                         inputs_dir=inputs_dir, input_roots=_pairs(input_roots, "--input-root"),
                         chain_vars=_pairs(chain_vars, "--var"))
    run_stages(command="build", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("build",), as_json=as_json, verbose=verbose, quiet=quiet, options=options)
