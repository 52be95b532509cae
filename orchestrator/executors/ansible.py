"""Ansible executor (ansible-runner): run one playbook on many hosts, results per host as values.

    results = run_playbook(PLAYBOOKS_DIR / "stage-engram.yml", cluster.file,
                           limit=["node1", "node2"], extravars={...},
                           artifact_dir=ctx.run_dir / "ansible" / "stage-engram", timeout_s=3600,
                           host_key_checking=cluster.host_key_checking,
                           known_hosts_file=cluster.known_hosts_file,
                           on_output=lambda host, line: logs[host].write(line))
    results["node1"].ok, .rc, .msg, .stdout_tail, .result_json

Rules it keeps:
- One ansible-playbook run for all hosts, `forks` = number of hosts: hosts run in parallel and a
  failed host never stops the others (Ansible drops it from the play; the rest go on).
- Host keys are checked unless the inventory opts out (`host_key_checking: false`):
  ANSIBLE_HOST_KEY_CHECKING, `-o StrictHostKeyChecking=yes` and, when the inventory names a
  known_hosts file, `-o UserKnownHostsFile=FILE` (ANSIBLE_SSH_COMMON_ARGS; an inventory's own
  `ansible_ssh_common_args` takes precedence, as Ansible's variable precedence says).
- The private data dir (inputs, artifacts: status, rc, stdout, job events) is `artifact_dir`,
  normally under the run record, so every run can be inspected afterwards.
- The whole run has a timeout (the runner kills ansible-playbook); tasks inside a playbook should
  carry their own (`timeout` task keyword, a `timeout` wrapper on the host, or `async`/`poll`).
- SSH pipelining is on (ANSIBLE_PIPELINING): one SSH exchange per task.
- A host's result: ok, rc (of the failed task), msg, the tail of its output and `result_json`:
  the fact `deployctl_result` if a task sets it, else the last stdout line of the host's last task
  that printed a JSON object (host-side deployctl ops print their result that way).
"""
from __future__ import annotations

import collections
import json
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..signals import describe_exit

TAIL_LINES = 20
RESULT_FACT = "deployctl_result"


@dataclass
class PlaybookHostResult:
    host: str
    ok: bool
    rc: int | None = None
    msg: str = ""
    stdout_tail: list[str] = field(default_factory=list)
    result_json: dict[str, Any] | None = None
    failed_task: str = ""
    unreachable: bool = False


class _HostState:
    def __init__(self, host: str):
        self.host = host
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.failed: dict[str, Any] | None = None      # the failing event's data
        self.unreachable = False
        self.result_json: dict[str, Any] | None = None
        self.fact_result: dict[str, Any] | None = None
        self.seen = False


def last_json_line(text: str | None) -> dict[str, Any] | None:
    """The last non-empty line of `text` if it is a JSON object."""
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
        return None
    return None


def _task_lines(kind: str, task: str, res: dict[str, Any]) -> list[str]:
    """What a task printed, for the host's log: status, rc, stdout, stderr, msg."""
    lines = [f"TASK [{task}] {kind}" + (f" rc={res['rc']}" if isinstance(res.get("rc"), int) else "")]
    for key in ("stdout", "stderr"):
        text = res.get(key)
        if isinstance(text, str) and text.strip():
            lines.extend(f"  {key}: {ln}" for ln in text.rstrip().splitlines())
    if res.get("msg") and kind != "ok":
        lines.append(f"  msg: {res['msg']}")
    return lines


def ssh_common_args(host_key_checking: bool, known_hosts_file: str | None) -> str:
    if not host_key_checking:
        return ""
    args = ["-o", "StrictHostKeyChecking=yes"]
    if known_hosts_file:
        args += ["-o", f"UserKnownHostsFile={known_hosts_file}"]
    return " ".join(args)


def run_playbook(playbook: str | Path, inventory_path: str | Path, *, limit: list[str],
                 extravars: dict[str, Any], artifact_dir: str | Path, timeout_s: float,
                 host_key_checking: bool = True, known_hosts_file: str | None = None,
                 on_output: Callable[[str, str], None] | None = None,
                 cancel: threading.Event | None = None) -> dict[str, PlaybookHostResult]:
    """Run `playbook` on the hosts in `limit`; one PlaybookHostResult per host, never an exception
    for a host's failure (only for a playbook that cannot start at all, e.g. a missing file)."""
    import ansible_runner

    playbook, inventory_path = Path(playbook).absolute(), Path(inventory_path).absolute()
    for p, what in ((playbook, "playbook"), (inventory_path, "inventory")):
        if not p.is_file():
            raise FileNotFoundError(f"{what} not found: {p}")
    data_dir = Path(artifact_dir).absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    states = {h: _HostState(h) for h in limit}
    stats: dict[str, Any] = {}
    lock = threading.Lock()

    def emit(host: str, line: str) -> None:
        st = states.get(host)
        if st is None:
            return
        st.tail.append(line)
        if on_output:
            on_output(host, line)

    def handler(ev: dict[str, Any]) -> bool:
        data = ev.get("event_data") or {}
        host = data.get("host")
        kind = ev.get("event", "")
        if kind == "playbook_on_stats":
            stats.update(data)
        if not host or host not in states:
            return True
        with lock:
            st = states[host]
            st.seen = True
            res = data.get("res") or {}
            task = data.get("task", "")
            if kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable", "runner_on_skipped"):
                short = kind.removeprefix("runner_on_")
                if data.get("ignore_errors") and short == "failed":
                    short = "failed (ignored)"
                for ln in _task_lines(short, task, res):
                    emit(host, ln)
                doc = last_json_line(res.get("stdout"))
                if doc is not None:
                    st.result_json = doc
                fact = (res.get("ansible_facts") or {}).get(RESULT_FACT)
                if isinstance(fact, dict):
                    st.fact_result = fact
                if kind == "runner_on_failed" and not data.get("ignore_errors"):
                    st.failed = {"task": task, "res": res, "json": doc}
                elif kind == "runner_on_unreachable":
                    st.unreachable = True
                    st.failed = {"task": task, "res": res, "json": None}
            elif kind == "runner_on_async_poll":
                emit(host, f"TASK [{task}] still running (async job {res.get('ansible_job_id', '?')})")
        return True

    envvars = {
        "ANSIBLE_HOST_KEY_CHECKING": "True" if host_key_checking else "False",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_DISPLAY_SKIPPED_HOSTS": "True",
        # one SSH exchange per module instead of put/chmod/run/remove: the per-task cost that
        # dominates short plays (needs no `requiretty` for become; deployctl connects as root)
        "ANSIBLE_PIPELINING": "True",
    }
    ssh_args = ssh_common_args(host_key_checking, known_hosts_file)
    if ssh_args:
        envvars["ANSIBLE_SSH_COMMON_ARGS"] = ssh_args
    # Without a cancel callback ansible-runner installs its own SIGINT/SIGTERM handlers and leaves
    # them in place: the process would then ignore SIGTERM (and Ctrl-C) after the play. Always give
    # it one, and put back whatever handlers were there.
    cancel = cancel if cancel is not None else threading.Event()
    saved = _signal_handlers()
    try:
        runner = ansible_runner.run(
            private_data_dir=str(data_dir), playbook=str(playbook), inventory=str(inventory_path),
            limit=",".join(limit), extravars=extravars, forks=max(1, len(limit)), envvars=envvars,
            event_handler=handler, quiet=True, timeout=int(timeout_s) if timeout_s else None,
            cancel_callback=cancel.is_set, settings={"suppress_ansible_output": True},
        )
    finally:
        _restore_signal_handlers(saved)
    status, rc = runner.status, runner.rc
    return {h: _host_result(st, status, rc, timeout_s, stats) for h, st in states.items()}


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(saved: dict[int, Any]) -> None:
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def _host_result(st: _HostState, status: str, rc: int | None, timeout_s: float,
                 stats: dict[str, Any]) -> PlaybookHostResult:
    result = st.fact_result if st.fact_result is not None else st.result_json
    if st.failed is not None:
        res, doc = st.failed["res"], st.failed["json"]
        msg = (doc or {}).get("error") or res.get("msg") or "failed"
        task_rc = res.get("rc") if isinstance(res.get("rc"), int) else None
        killed = describe_exit(task_rc)
        if killed and not (doc or {}).get("error"):
            # the command module says only "non-zero return code" (rc -9 for a SIGKILL)
            msg = f"the task's command {killed}" if msg == "non-zero return code" else f"{msg}; {killed}"
        if not (doc or {}).get("error") and isinstance(res.get("stderr"), str) and res["stderr"].strip():
            last = res["stderr"].strip().splitlines()[-1]
            msg = f"{msg}; its last stderr line: {last}" if killed else f"{msg}: {last}"
        return PlaybookHostResult(st.host, False, task_rc, str(msg), list(st.tail), result,
                                  st.failed["task"], st.unreachable)
    done = st.host in (stats.get("processed") or {}) and not (stats.get("failures") or {}).get(st.host) \
        and not (stats.get("dark") or {}).get(st.host)
    if done:
        # the play ran to its end on this host (another host may have failed: not this one's concern)
        return PlaybookHostResult(st.host, True, 0, "ok", list(st.tail), result)
    if status == "timeout":
        msg = f"ansible-playbook timed out after {timeout_s:.0f} s before this host finished"
    elif status == "canceled":
        msg = "cancelled before this host finished"
    elif not st.seen:
        msg = f"no result from ansible-playbook for this host (status {status}, rc {rc}); see its stdout"
    else:
        msg = f"ansible-playbook ended with status {status} (rc {rc})"
    return PlaybookHostResult(st.host, False, rc, msg, list(st.tail), result)
