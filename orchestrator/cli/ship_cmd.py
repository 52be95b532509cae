"""deployctl ship: ship the serving image from the head to every worker, only the layers each lacks."""
from __future__ import annotations

import json

import click

from ..runoptions import RunOptions
from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("ship")
@deployment_options
@click.option("--image", default=None, metavar="IMAGE",
              help="Image to ship (default: the recipe's engine.image).")
@click.option("--stall-timeout", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="A worker that takes no bytes this long fails (default 60).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="The whole transfer's time limit (default 7200).")
@click.option("--head-ssh-key", default=None, metavar="PATH",
              help="Key the HEAD uses to SSH to the workers, a path on the head "
                   "(default: the inventory's ansible_ssh_private_key_file).")
@click.option("--head-known-hosts", default=None, metavar="PATH",
              help="known_hosts file the HEAD checks the workers' keys against, a path on the head "
                   "(default: the inventory's known_hosts_file).")
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet, image, stall_timeout, timeout_s,
            head_ssh_key, head_known_hosts):
    """Ship the serving image from the head to every worker, only the layers each lacks.

    The head runs `docker save` once and streams to all workers in parallel over its own SSH
    (head to worker, not through this machine); a worker that already has the image ID is
    skipped, the others get only the layers they lack, and every worker's image ID is checked
    against the head's afterwards.
    """
    sets = tuple(sets) + ((f"engine.image={json.dumps(image)}",) if image else ())
    options = RunOptions(ship_stall_s=stall_timeout, ship_timeout_s=timeout_s,
                         ship_head_ssh_key=head_ssh_key, ship_head_known_hosts=head_known_hosts)
    run_stages(command="ship", inventory=inventory, recipe=recipe, sets=sets, only=("ship",),
               as_json=as_json, verbose=verbose, quiet=quiet, options=options)
