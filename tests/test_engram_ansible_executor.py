"""orchestrator/executors/ansible.py on local-connection hosts: per-host results as values, the op's JSON,
output routed per host, a failed host not stopping the others, the run's timeout."""
from __future__ import annotations

import sys
import textwrap

import yaml

from orchestrator.executors.ansible import last_json_line, run_playbook, ssh_common_args

PLAYBOOK = textwrap.dedent("""\
    - hosts: all
      gather_facts: false
      tasks:
        - name: first
          ansible.builtin.command:
            argv: "{{ jobs[inventory_hostname] }}"
          register: out
          failed_when: out.rc != 0
          timeout: 60
        - name: second
          ansible.builtin.set_fact:
            deployctl_result: {"status": "ok", "host": "{{ inventory_hostname }}"}
          when: inventory_hostname == 'd'
    """)


def inventory(tmp_path, hosts):
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"vars": {"ansible_connection": "local",
                                                     "ansible_python_interpreter": sys.executable},
                                            "hosts": {h: {} for h in hosts}}}))
    return inv


def test_per_host_results(tmp_path):
    pb = tmp_path / "pb.yml"
    pb.write_text(PLAYBOOK)
    py = sys.executable
    jobs = {
        "a": [py, "-c", "print('working'); print('{\"status\": \"ok\", \"n\": 1}')"],
        "b": [py, "-c", "import sys; print('{\"status\": \"failed\", \"error\": \"disk on fire\"}'); sys.exit(3)"],
        "c": [py, "-c", "import sys; sys.stderr.write('no json here\\n'); sys.exit(4)"],
        "d": [py, "-c", "print('plain text')"],
    }
    lines: dict[str, list[str]] = {}
    res = run_playbook(pb, inventory(tmp_path, jobs), limit=list(jobs), extravars={"jobs": jobs},
                       artifact_dir=tmp_path / "run", timeout_s=300, host_key_checking=True,
                       on_output=lambda h, line: lines.setdefault(h, []).append(line))
    assert res["a"].ok and res["a"].result_json == {"status": "ok", "n": 1}
    assert not res["b"].ok and res["b"].rc == 3 and res["b"].msg == "disk on fire"
    assert res["b"].failed_task == "first" and res["b"].result_json["status"] == "failed"
    assert not res["c"].ok and res["c"].rc == 4 and "no json here" in res["c"].msg
    assert res["c"].result_json is None
    assert res["d"].ok and res["d"].result_json == {"status": "ok", "host": "d"}   # the fact wins
    assert any("stdout: working" in ln for ln in lines["a"])
    assert not any("disk on fire" in ln for ln in lines["a"])                     # each host its own
    assert any("TASK [first] failed rc=3" in ln for ln in res["b"].stdout_tail)
    assert (tmp_path / "run" / "artifacts").is_dir()


def test_run_timeout_fails_unfinished_hosts(tmp_path):
    pb = tmp_path / "pb.yml"
    pb.write_text(PLAYBOOK)
    jobs = {"a": ["sleep", "60"], "b": ["sleep", "60"]}
    res = run_playbook(pb, inventory(tmp_path, jobs), limit=list(jobs), extravars={"jobs": jobs},
                       artifact_dir=tmp_path / "run", timeout_s=8)
    for h in jobs:
        assert not res[h].ok and "timed out after 8 s" in res[h].msg, res[h]


def test_helpers():
    assert last_json_line('x\n{"a": 1}\n\n') == {"a": 1}
    assert last_json_line('{"a": 1}\nnot json') is None
    assert last_json_line("") is None
    assert ssh_common_args(True, "/k") == "-o StrictHostKeyChecking=yes -o UserKnownHostsFile=/k"
    assert ssh_common_args(False, "/k") == ""


def test_signal_handlers_are_left_as_they_were(tmp_path):
    """ansible-runner installs SIGINT/SIGTERM handlers of its own; after a play the caller's are back,
    so deployctl (or anything embedding it) still stops on SIGTERM and Ctrl-C."""
    import signal
    pb = tmp_path / "pb.yml"
    pb.write_text(PLAYBOOK)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    res = run_playbook(pb, inventory(tmp_path, ["a"]), limit=["a"],
                       extravars={"jobs": {"a": [sys.executable, "-c", "print(1)"]}},
                       artifact_dir=tmp_path / "run", timeout_s=120, host_key_checking=True)
    assert res["a"].ok
    assert {s: signal.getsignal(s) for s in before} == before


# -- stage-engram's apply runs the jobs its plan carries (orchestrator/stages/tableop.py) --------

def test_stage_engram_apply_executes_the_planned_argv(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from orchestrator.deployment import load_deployment
    from orchestrator.executors.ansible import PlaybookHostResult
    from orchestrator.runrecord import RunContext
    from orchestrator.stages import build_plan, stage_engram
    from tests.tableop_double import Recorder, ok, with_op

    repo = Path(__file__).resolve().parents[1]
    dep = load_deployment(repo / "inventories/spark4.yml")
    acts = list(build_plan(dep, only=("stage-engram",)).stage("stage-engram").actions)
    # spark3's action carries another destination than the deployment would give: it must run as planned
    acts[2] = with_op(acts[2], tuple("/elsewhere" if a == dep.engram_dir(dep.cluster.host("spark3")) else a
                                     for a in acts[2].details["job"]["op"]))
    assert "/elsewhere" in acts[2].command
    killed = PlaybookHostResult("spark4", False, 124, "non-zero return code", ["..."], None,
                                "Stage the rank's rows")
    rec = Recorder(monkeypatch, {"spark2": ok("spark2", {"status": "ok", "bytes": 2e9, "seconds": 1}),
                                 "spark3": ok("spark3", {"status": "skipped", "reason": "already staged: rank 2"}),
                                 "spark4": killed},
                   done={"spark1": "already staged: rank 0 (checked)"})
    ctx = RunContext(tmp_path / "run")
    res = stage_engram.apply(dep, acts, ctx)

    assert [p.check_argv for p in rec.probes] == [
        tuple("/dev/stdin" if x == a.details["job"]["spec_path"] else x for x in a.command[4:]) + ("--check",)
        for a in acts]
    (run,) = rec.runs                                     # one playbook run, for the hosts with work
    assert run["limit"] == ["spark2", "spark3", "spark4"]
    hosts = run["extravars"]["engram_hosts"]
    for a in acts:
        assert hosts[a.host]["argv"] == list(a.command)   # executed = planned
    assert json.loads((ctx.run_dir / "stage-engram-vars.json").read_text()) == run["extravars"]
    assert [r.status for r in res] == ["skipped", "ok", "skipped", "failed"]
    assert res[0].message == "already staged: rank 0 (checked)"
    assert res[1].message.startswith("staged 2.00 GB to ")
    assert res[3].rc == 124 and res[3].message.startswith(
        f"engram-stage did not finish within {acts[3].details['timeout_s']} s on the host and was killed")
    log = Path(res[2].log_path).read_text()
    assert "$ " + " ".join(acts[2].command) in log and "/elsewhere" in log
    ctx.close()
