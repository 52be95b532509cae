"""A stand-in for ansible-runner and the SSH fast path under orchestrator/stages/tableop.py: records what a
table stage's apply executes (limit, the playbook variables, the probes) and answers per host."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from orchestrator.executors import ansible
from orchestrator.executors.ansible import PlaybookHostResult
from orchestrator.plan import Action
from orchestrator.stages import tableop
from orchestrator.stages.tableop import TableJob


class Recorder:
    def __init__(self, monkeypatch, answers: dict[str, PlaybookHostResult], done: dict[str, str] | None = None):
        self.answers, self.done = answers, done or {}
        self.runs: list[dict[str, Any]] = []
        self.probes: list[tableop.Probe] = []
        monkeypatch.setattr(ansible, "run_playbook", self.run_playbook)
        monkeypatch.setattr(tableop, "already_done", self.already_done)

    def already_done(self, dep, probes, pyz, why_not=None):
        self.probes += probes
        return {p.host: self.done[p.host] for p in probes if p.host in self.done}

    def run_playbook(self, playbook, inventory, *, limit, extravars, **kw):
        self.runs.append({"playbook": playbook, "limit": list(limit), "extravars": extravars, **kw})
        return {h: self.answers[h] for h in limit}


def ok(host: str, doc: dict[str, Any]) -> PlaybookHostResult:
    return PlaybookHostResult(host, True, 0, "ok", [], doc)


def with_op(action: Action, op: tuple[str, ...]) -> Action:
    """The action carrying another op (as if planned differently): apply must run this one."""
    job = replace(TableJob.of(action), op=op)
    return replace(action, command=job.argv, details={**action.details, "job": job.to_json()}, job=job)
