"""What a command asks of its run (RunOptions, frozen) and what one stage hands to a later one (RunState).

The CLI builds one RunOptions per command (orchestrator/cli/*.py) and passes it to RunContext; stages and
domain code read its attributes. A field left at its default means "the command did not say": each reader
falls back to its own default (the recipe's, the inventory's, the module's), as before. RunState is the
run's mutable hand-over between stages: the hosts launch started (health reads them), the cleanups the
runner calls, the stages' shared SSH sessions. Leaf module: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol


def _frozen_map(m: Mapping[str, str] | None) -> Mapping[str, str] | None:
    return None if m is None else MappingProxyType(dict(m))


@dataclass(frozen=True)
class SyncModelOptions:
    """`deployctl sync-model` flags; None: modelsync.settings.Settings' default (`up` uses the defaults)."""
    io_timeout: float | None = None        # --io-timeout
    timeout: float | None = None           # --timeout (whole transfer per worker)
    bwlimit_mbps: float | None = None      # --bwlimit
    rehash: bool | None = None             # --rehash (None when not given)
    head_key: str | None = None            # --head-key (a path on the head)
    head_known_hosts: str | None = None    # --head-known-hosts (a path on the head)


@dataclass(frozen=True)
class RunOptions:
    """One typed field per command option a stage reads; defaults = the flag was not given."""
    # launch / up
    keep_on_failure: bool = False          # --keep-on-failure: launch registers no failure cleanup
    # ple (write-ple)
    verify: bool = False                   # --verify: re-hash a kept table file
    # ship
    ship_stall_s: float | None = None      # --stall-timeout
    ship_timeout_s: float | None = None    # --timeout
    ship_head_ssh_key: str | None = None   # --head-ssh-key (a path on the head)
    ship_head_known_hosts: str | None = None  # --head-known-hosts (a path on the head)
    # fetch-model
    fetch_rehash: bool = False             # fetch-model --rehash: verify every file again by its hash
    # fabric
    fabric_fresh: bool = False             # `deployctl fabric`: measure, never reuse a cached check
    # sync-model
    sync_model: SyncModelOptions = field(default_factory=SyncModelOptions)
    # route
    route_check_only: bool = False         # `deployctl health`: the route stage checks the router, changes nothing
    # build
    local: bool = False                    # --local: this machine's Docker engine
    ci: bool = False                       # --ci: job-summary table under GitHub Actions
    update_lock: bool = False              # --update-lock
    prune: bool = False                    # --prune
    no_cache: bool = False                 # --no-cache
    inputs_dir: str | None = None          # --inputs-dir
    input_roots: Mapping[str, str] | None = None  # --input-root NAME=DIR (read-only mapping)
    chain_vars: Mapping[str, str] | None = None   # --var NAME=VALUE (read-only mapping)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_roots", _frozen_map(self.input_roots))
        object.__setattr__(self, "chain_vars", _frozen_map(self.chain_vars))


class ShellPool(Protocol):
    """What RunState.shells holds: executors/shells.py `Shells` (named by shape: this module is a leaf)."""

    def __getitem__(self, host: str) -> Any: ...

    def close(self) -> None: ...


@dataclass
class RunState:
    """Per-run values one stage hands to a later one (mutable; never set from the command line)."""
    launched: set[str] = field(default_factory=set)       # hosts whose containers launch started (health)
    cleanups: list[Callable[[], None]] = field(default_factory=list)          # the runner runs these last
    failure_cleanups: list[Callable[[], None]] = field(default_factory=list)  # ... and these when a stage failed
    proven: dict[str, set[str]] = field(default_factory=dict)   # host -> table stages whose tables this run proved
    shells: ShellPool | None = None   # the stages' shared SSH sessions (executors/shells.py run_shells), closed by the CLI
