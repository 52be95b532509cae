"""deployctl fetch-model: the recipe's checkpoint from the Hugging Face Hub onto the head."""
from __future__ import annotations

import click

from ..runoptions import RunOptions
from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("fetch-model")
@deployment_options
@click.option("--rehash", is_flag=True,
              help="Verify every file of the snapshot again by its hash, not by size and mtime.")
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet, rehash):
    """Download the recipe's model.repo at model.revision into the head's Hugging Face cache.

    The download runs ON THE HEAD (its disk, its uplink) with the Hub's own client from the serving
    image. model.revision is resolved to a commit once (a branch is not pinned: the plan says so);
    only the files model.allow_patterns select are fetched; free space is checked against the Hub's
    file sizes first. An interrupted download resumes; every file's sha256 must equal the Hub's
    before it enters the snapshot. A complete, verified snapshot is a no-op decided in seconds.

    Token for gated or private repos: HF_TOKEN in the environment, or hf_token_file in the inventory.
    Endpoint: hf_endpoint in the inventory (default https://huggingface.co).

    Exit 0 ok or nothing to do, 1 the download or a hash check failed, 2 bad input (no access, no
    such repo or revision, not enough space: nothing written).
    """
    run_stages(command="fetch-model", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("fetch-model",), as_json=as_json, verbose=verbose, quiet=quiet,
               options=RunOptions(fetch_rehash=rehash))
