"""deployctl engram ranges|stage|check-rank|vars, and deployctl stage (the pipeline stage stage-engram)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import DeployctlError, InputError
from ..recipe import Recipe, load_recipe
from ..stages.stage_engram import engram_spec
from ..hostside import engram_stage as op
from ..hostside import engram_checks as ec
from ..hostside import engram_spec as es
from .common import deployment_options, emit_json, handle_errors, inventory_option, recipe_options
from .pipeline import run_stages


def _recipe(recipe: str | None, sets: tuple[str, ...], inventory: str | None = None) -> Recipe:
    """--recipe, else the recipe the inventory names (with its overrides)."""
    if recipe:
        return load_recipe(recipe, sets).recipe
    from ..deployment import load_deployment
    return load_deployment(inventory, None, sets).recipe


def _tp(r: Recipe, ranks: int | None) -> int:
    if ranks is not None and ranks < 1:
        raise InputError(f"--ranks must be >= 1, got {ranks}", key="--ranks")
    return ranks or r.parallelism.tensor_parallel


def range_rows(r: Recipe, tp: int) -> list[dict]:
    """One object per (rank, layer): rows [row_start, row_end), heads, rows, bytes (weight + scale)."""
    out = []
    for rank in range(tp):
        spec = engram_spec(r, rank, tp)
        for rr in spec.ranges():
            out.append({"rank": rank, "layer": rr.layer, "head_start": rr.head_start, "head_end": rr.head_end,
                        "row_start": rr.row_start, "row_end": rr.row_end, "rows": rr.rows,
                        "weight_bytes": rr.rows * spec.weight_row_bytes,
                        "scale_bytes": rr.rows * spec.scale_row_bytes,
                        "bytes": rr.rows * spec.row_bytes})
    return out


def table_options(f):
    """--recipe/--set and --inventory (whose recipe is used without --recipe), plus --ranks."""
    f = click.option("--ranks", type=int, default=None,
                     help="Tensor-parallel ranks (default: the recipe's tensor_parallel).")(f)
    return inventory_option(recipe_options(f))


@click.group("engram")
def engram_group() -> None:
    """DeepSeek-V4.1-Flash Engram tables: per-rank row ranges and local staging."""


@engram_group.command("ranges")
@table_options
@click.option("--json", "as_json", is_flag=True, help="A JSON list, one object per rank and layer.")
@handle_errors
def ranges(recipe, sets, ranks, inventory, as_json):
    """Per rank and layer: [row_start, row_end), rows and bytes (weight + scale).

    Ranks own whole hash heads (sub-tables), ceil(heads / ranks) each, contiguous and in order;
    the last ranks may own fewer, or none.
    """
    r = _recipe(recipe, tuple(sets), inventory)
    rows = range_rows(r, _tp(r, ranks))
    if as_json:
        emit_json(rows)
        return
    click.echo(f"{r.name}: {len(r.engram.geometry.layers)} Engram layer(s), {_tp(r, ranks)} rank(s), "
               f"{engram_spec(r, 0).row_bytes} B per row (weight + scale)")
    head = f"{'rank':>4} {'layer':>5} {'heads':>9} {'row_start':>13} {'row_end':>13} {'rows':>13} {'bytes':>17} {'GB':>8}"
    click.echo(head)
    for x in rows:
        heads = f"[{x['head_start']}, {x['head_end']})"
        click.echo(f"{x['rank']:>4} {x['layer']:>5} {heads:>9} {x['row_start']:>13,} {x['row_end']:>13,} "
                   f"{x['rows']:>13,} {x['bytes']:>17,} {x['bytes'] / 1e9:>8.2f}")
    per_rank: dict[int, int] = {}
    for x in rows:
        per_rank[x["rank"]] = per_rank.get(x["rank"], 0) + x["bytes"]
    click.echo("per rank: " + ", ".join(f"{k}: {v / 1e9:.2f} GB" for k, v in per_rank.items()))


@engram_group.command("stage")
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="Checkpoint folder (model.safetensors.index.json + shards).")
@click.option("--dest", required=True, type=click.Path(file_okay=False), help="Folder on local NVMe.")
@click.option("--rank", required=True, type=int, help="This host's tensor-parallel rank.")
@table_options
@click.option("--verify", is_flag=True, help="Re-hash every staged chunk against the manifest.")
@click.option("--threads", type=int, default=None, help="Worker threads (default min(4, CPUs)).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@handle_errors
def stage_local(checkpoint, dest, rank, recipe, sets, ranks, inventory, verify, threads, as_json):
    """Stage one rank's Engram rows from a local checkpoint into DEST (the host-side operation).

    Skips in well under a second when DEST already holds this rank's rows from the same checkpoint;
    restages when the checkpoint, rank, geometry or layout changed. Exit 0 ok or skipped,
    1 failed, 2 bad input.
    """
    r = _recipe(recipe, tuple(sets), inventory)
    tp = _tp(r, ranks)
    if not 0 <= rank < tp:
        raise InputError(f"--rank {rank} is outside 0..{tp - 1} ({tp} ranks)", key="--rank")
    spec = engram_spec(r, rank, tp)
    log = None if as_json else (lambda m: click.echo(m, err=True))
    try:
        res = op.stage(spec, checkpoint, dest, verify=verify, threads=threads, log=log)
    except DeployctlError as e:
        if as_json:
            emit_json(op.error_result(e))
        raise
    if as_json:
        emit_json(res)
    elif res["status"] == "skipped":
        click.echo(f"skipped: {res['reason']}")
    else:
        click.echo(f"staged rank {rank} of {tp} ({res['layout']}): {res['bytes'] / 1e9:.3f} GB in "
                   f"{res['seconds']:.1f} s ({res['mb_per_s']:.0f} MB/s) into {res['dest']}; "
                   f"{res['fidelity_rows']} rows checked against the checkpoint"
                   + ("; verified" if res.get("verified") else ""))


@engram_group.command("check-rank")
@click.option("--dest", required=True, type=click.Path(file_okay=False), help="The staged folder.")
@click.option("--rank", required=True, type=int)
@table_options
@handle_errors
def check_rank_cmd(dest, rank, recipe, sets, ranks, inventory):
    """Refuse (exit 1) unless DEST holds exactly the rows RANK owns (what launch checks)."""
    r = _recipe(recipe, tuple(sets), inventory)
    spec = engram_spec(r, rank, _tp(r, ranks))
    ec.check_rank(dest, spec.ranges())
    click.echo(f"{dest}: rank {rank} of {spec.tp}: {json.dumps(es.local_ranges(spec))}")


@engram_group.command("vars")
@inventory_option
@recipe_options
@click.option("--pyz", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The tables zipapp (default: build it into --bundle-dir).")
@click.option("--bundle-dir", type=click.Path(file_okay=False), default=".", show_default=True)
@handle_errors
def vars_cmd(inventory, recipe, sets, pyz, bundle_dir):
    """Print the variables of playbooks/stage-engram.yml for an inventory (for ansible-playbook -e @FILE)."""
    from ..deployment import load_deployment
    from ..stages.stage_engram import host_job, playbook_vars
    from ..hostside import bundle
    dep = load_deployment(inventory, recipe, tuple(sets))
    if dep.recipe.engram is None:
        raise InputError(f"recipe {dep.recipe.name} has no Engram tables", key="engram")
    pyz = Path(pyz).absolute() if pyz else bundle.build(Path(bundle_dir).absolute())
    emit_json(playbook_vars([host_job(dep, h) for h in dep.cluster.hosts], pyz))


@click.command("stage")
@deployment_options
@click.option("--verify", is_flag=True,
              help="Re-hash every staged chunk against the manifest (a mismatch fails the host and removes "
                   "its manifest: the next run restages it).")
@handle_errors
def stage_command(inventory, recipe, sets, as_json, verbose, quiet, verify):
    """Stage every host's Engram rows onto its NVMe, in parallel, through Ansible.

    Runs playbooks/stage-engram.yml (by hand: see its header). A host whose NVMe lacks the space
    fails alone, before anything is written; the others carry on. A host already staged is proven
    (docs/table-proof.md) and kept. Exit 1 if any host failed.
    """
    from ..runoptions import RunOptions
    run_stages(command="stage", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("stage-engram",), as_json=as_json, verbose=verbose, quiet=quiet,
               options=RunOptions(verify=verify))
