"""deployctl sync-model: give every node the exact checkpoint (rsync from the head, or verify a shared mount)."""
from __future__ import annotations

import click

from ..runoptions import RunOptions, SyncModelOptions
from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("sync-model")
@deployment_options
@click.option("--io-timeout", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="A worker that takes no data this long is given up (rsync --timeout; default 60).")
@click.option("--timeout", "total_timeout", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="Whole transfer per worker (default 300 s + the bytes at 20 MB/s).")
@click.option("--bwlimit", type=click.FloatRange(min=0.1), default=None, metavar="MB/S",
              help="Bandwidth per worker (through a chain: of every hop, paced at its source), to leave room "
                   "for other traffic on the link.")
@click.option("--rehash", is_flag=True,
              help="Ignore the hash caches and re-read every file (bit rot that kept size and mtime).")
@click.option("--head-key", default=None, metavar="PATH",
              help="SSH key ON THE HEAD for head -> worker rsync (default: the inventory's key path).")
@click.option("--head-known-hosts", default=None, metavar="PATH",
              help="known_hosts ON THE HEAD with the workers' host keys (default: the inventory's).")
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet, io_timeout, total_timeout, bwlimit, rehash,
            head_key, head_known_hosts):
    """Give every node the exact checkpoint (rsync from the head, or verify a shared mount).

    model.source head (default): the head's checkpoint folder is hashed (sha256, cached by size and
    mtime), every worker is checked against it, and only the files that differ are pushed from the
    head to the workers in parallel (rsync on the head; resumable), after a free-space check. A
    second run on a synced cluster sends nothing. model.source shared: every node must see the
    head's copy on the same mounted filesystem (model.shared_path); nothing is copied.

    Exit 0 ok or nothing to do, 1 a host failed (others keep their results), 2 bad input.
    """
    opts = SyncModelOptions(io_timeout=io_timeout, timeout=total_timeout, bwlimit_mbps=bwlimit,
                            rehash=rehash or None, head_key=head_key, head_known_hosts=head_known_hosts)
    run_stages(command="sync-model", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("sync-model",), as_json=as_json, verbose=verbose, quiet=quiet,
               options=RunOptions(sync_model=opts))
