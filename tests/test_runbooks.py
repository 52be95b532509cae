"""The runbooks' deployctl commands cannot rot: every one is parsed and checked here.

Convention (docs/runbooks/README.md): every line of a fenced code block in docs/runbooks/*.md that
starts with `deployctl ` (a trailing backslash continues it) is a command of the runbook. This test
- parses it with deployctl's own command line (unknown commands, options, bad values fail),
- loads the deployment it names (inventory, recipe, every --set is validated), and
- runs it with --dry-run appended when the command has --dry-run (up, launch, down): the plan of the
  exact command, against the checked-in inventory it names, must exit 0.
Commands without --dry-run (status, logs, health, stage, ...) would need the real hosts; they are
parsed and their deployment loaded, not run.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from orchestrator.cli import cli
from orchestrator.deployment import load_deployment
from orchestrator.stages import build_plan

REPO = Path(__file__).resolve().parents[1]
RUNBOOKS = REPO / "docs" / "runbooks"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
EXPECTED = {"bring-up-4-node.md", "restart-after-node-reboot.md", "replace-a-node.md",
            "roll-back-image.md", "restage-after-checkpoint-update.md", "debug-hung-nccl-start.md",
            "model-went-down-at-night.md", "distribution-node-failed.md"}


def commands(text: str) -> list[str]:
    out = []
    for block in FENCE.findall(text):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            if line.startswith("$ "):
                line = line[2:]
            if not line.startswith("deployctl "):
                continue
            while line.endswith("\\") and i < len(lines):
                line = line[:-1] + " " + lines[i].strip()
                i += 1
            out.append(line.split(" #", 1)[0].strip())
    return out


def all_commands() -> list[tuple[str, str]]:
    return [(p.name, c) for p in sorted(RUNBOOKS.glob("*.md")) for c in commands(p.read_text())]


def test_every_runbook_is_there_with_commands():
    found = {p.name for p in RUNBOOKS.glob("*.md")}
    assert EXPECTED <= found, EXPECTED - found
    for name in EXPECTED:
        assert commands((RUNBOOKS / name).read_text()), f"{name} has no deployctl command"


def _resolve(argv: list[str]) -> tuple[click.Command, list[str], list[str]]:
    cmd: click.Command = cli
    path = []
    while isinstance(cmd, click.Group) and argv and not argv[0].startswith("-"):
        sub = cmd.get_command(click.Context(cmd), argv[0])
        assert sub is not None, f"no command {' '.join(path + argv[:1])!r}"
        path.append(argv.pop(0))
        cmd = sub
    return cmd, path, argv


@pytest.mark.parametrize("runbook, command", all_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_runbook_command(runbook, command):
    argv = shlex.split(command)[1:]
    cmd, path, rest = _resolve(list(argv))
    try:
        ctx = cmd.make_context(" ".join(["deployctl", *path]), list(rest), resilient_parsing=False)
    except click.ClickException as e:
        pytest.fail(f"{runbook}: `{command}`: {e.format_message()}")
    params = ctx.params
    if "inventory" in params:
        inv = params["inventory"]
        assert inv, f"{runbook}: `{command}` must name its inventory with -i"
        dep = load_deployment(REPO / inv, params.get("recipe"), tuple(params.get("sets") or ()))
        if params.get("only") or params.get("skip"):
            build_plan(dep, tuple(params.get("only") or ()), tuple(params.get("skip") or ()))
        if "hosts" in params:
            for h in params["hosts"]:
                dep.cluster.host(h)
    names = {p.name for p in cmd.params}
    if "dry_run" in names and not params.get("dry_run"):
        p = subprocess.run([sys.executable, "-m", "orchestrator", *argv, "--dry-run"], capture_output=True,
                           text=True, cwd=REPO, timeout=120)
        assert p.returncode == 0, f"{runbook}: `{command} --dry-run` exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
