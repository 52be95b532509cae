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
