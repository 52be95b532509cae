"""#35 on the test cluster: the supervisor `up` installs brings a TP=2 group back by itself (the engine
double in the vllm-cpu recipe on node3-4; the real vLLM's own restart is in tests/test_real_vllm.py),
survives its own crash and a restart of a worker's and of the head's Docker engine, gives up after its
restart budget, acts on sustained low memory, and never restarts anything after `deployctl down`."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.test_launch import _docker, containers, dctl, double_image, out, remove_all  # noqa: F401
from tests.test_real_vllm import DOUBLE_IMAGE, SERVED, _forget_releases, api_at, hub, inventory, up  # noqa: F401

pytestmark = pytest.mark.cluster
DEP, PORT, MASTER = "sv2", 18120, 29620
SUP = "deployctl.supervisor"


@pytest.fixture(autouse=True)
def leave_nothing(cluster):
    yield
    remove_all(cluster, DEP)


def supervisors(cluster, host, deployment: str = DEP) -> list[dict]:
    p = _docker(host.docker_host, "ps", "-aq", "--filter", f"label={SUP}={deployment}")
    ids = p.stdout.split()
    return json.loads(_docker(host.docker_host, "inspect", *ids).stdout) if ids else []


def engines(cluster, host, deployment: str = DEP) -> list[dict]:
    ids = containers(cluster, host.name, deployment)
    return json.loads(_docker(host.docker_host, "inspect", *ids).stdout) if ids else []


def incidents(inv) -> dict:
    p = dctl("incidents", "-i", str(inv), "--json", timeout=60)
    assert p.returncode == 0, out(p)
    return json.loads(p.stdout)


def wait_incident(inv, n: int, outcome: str | None = None, timeout: float = 120) -> dict:
    """The Nth incident (1-based), once it has an outcome other than `open` (or one starting with OUTCOME)."""
    end = time.monotonic() + timeout
    seen = None
    while time.monotonic() < end:
        seen = incidents(inv)
        items = seen["incidents"]
        if len(items) >= n and items[n - 1]["outcome"] != "open" and (outcome is None or items[n - 1]["outcome"].startswith(outcome)):
            return items[n - 1]
        time.sleep(1)
    raise AssertionError(f"no incident #{n} with an outcome within {timeout:g}s: {json.dumps(seen)[-3000:]}")


def wait_state(inv, want: str, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    st = None
    while time.monotonic() < end:
        st = incidents(inv)["state"] or {}
        if st.get("state") == want:
            return st
        time.sleep(0.5)
    raise AssertionError(f"the supervisor is not {want} within {timeout:g}s: {st}")


def chat(host) -> int:
    return api_at(host, PORT, "/v1/chat/completions",
                  {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)[0]


def test_the_supervisor_restarts_the_group_survives_its_crash_and_an_engine_restart_then_gives_up(
        cluster, hub, double_image, tmp_path):
    head, worker = cluster.hosts[2], cluster.hosts[3]
    inv = inventory(cluster, hub, tmp_path, DEP, [head, worker], PORT, MASTER,
                    {"engine.image": DOUBLE_IMAGE, "engine.env.DOUBLE_LOAD_S": "1", "health.startup_timeout_s": 120,
                     "supervise.interval_s": 1, "supervise.backoff_s": 1, "supervise.max_restarts": 3,
                     "supervise.window_s": 900})
    for h in (head, worker):
        for d in supervisors(cluster, h) + engines(cluster, h):
            _docker(h.docker_host, "rm", "-f", d["Id"])
    p = up(inv, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    # one agent per host, restart policy unless-stopped, not counted as an engine
    for h in (head, worker):
        (agent,) = supervisors(cluster, h)
        assert agent["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
        assert agent["State"]["Running"], agent["State"]
        assert len(engines(cluster, h)) == 1
    wait_state(inv, "watching")
    p = dctl("status", "-i", str(inv), timeout=60)
    assert p.returncode == 0 and "Supervisor: watching" in p.stdout, out(p)
    # a no-op up keeps the same agents
    ids = {h.name: supervisors(cluster, h)[0]["Id"] for h in (head, worker)}
    p = up(inv, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    assert {h.name: supervisors(cluster, h)[0]["Id"] for h in (head, worker)} == ids, "a no-op up replaced them"

    # 1. the worker's engine is killed: the whole group restarts, workers and head, and serves again
    started = {h.name: engines(cluster, h)[0]["State"]["StartedAt"] for h in (head, worker)}
    t0 = time.monotonic()
    _docker(worker.docker_host, "kill", engines(cluster, worker)[0]["Id"])
    inc = wait_incident(inv, 1)
    took = time.monotonic() - t0
    assert inc["outcome"] == "recovered", inc
    assert inc["kind"] == "rank-exited" and inc["evidence"]["host"] == worker.name, inc
    assert "exit code 137 (SIGKILL)" in inc["ranks"][worker.name]["exit"], inc["ranks"]
    assert inc["ranks"][worker.name]["log_tail"], "the killed rank's last log lines"
    assert set(inc["mem_available_gib"]) == {head.name, worker.name}
    assert all(inc["specs"].values()), "each rank's spec digest"
    steps = [a["what"] for a in inc["actions"]]
    assert steps[0].startswith("stopping every rank") and any(s.startswith("ready") for s in steps), steps
    assert [s for s in steps if s.startswith("starting")] == [f"starting {worker.name}", f"starting {head.name}"], \
        "the recipe's start order (workers first)"
    now = {h.name: engines(cluster, h)[0]["State"]["StartedAt"] for h in (head, worker)}
    assert all(now[n] != started[n] for n in now), "every rank was restarted, the head too"
    assert chat(head) == 200
    print(f"\n[supervisor] kill -> serving again in {took:.1f}s (incident: {inc['recovery_s']}s)")
    p = dctl("incidents", "-i", str(inv), inc["id"][:15], timeout=60)
    assert p.returncode == 0 and "rank-exited" in p.stdout and worker.name in p.stdout, out(p)
    p = dctl("status", "-i", str(inv), timeout=60)
    assert f"last incident {inc['id']}" in " ".join(p.stdout.split()), out(p)

    # 2. the supervisor's own crash: Docker restarts it; it keeps its state, no incident
    (agent,) = supervisors(cluster, head)
    os.kill(agent["State"]["Pid"], 9)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        (agent,) = supervisors(cluster, head)
        if agent["RestartCount"] >= 1 and agent["State"]["Running"]:
            break
        time.sleep(0.5)
    assert agent["RestartCount"] >= 1 and agent["State"]["Running"], agent["State"]
    wait_state(inv, "watching")
    assert len(incidents(inv)["incidents"]) == 1

    # 3. the worker's Docker engine restarts (its engine container stops; the agent comes back by policy)
    cluster.stop_dockerd(worker)
    cluster.start_dockerd(worker)
    inc = wait_incident(inv, 2, timeout=180)
    assert inc["outcome"] == "recovered" and inc["evidence"]["host"] == worker.name, inc
    assert chat(head) == 200

    # 3b. the head's Docker engine restarts: its supervisor comes back by its policy, with its state
    cluster.stop_dockerd(head)
    cluster.start_dockerd(head)
    inc = wait_incident(inv, 3, timeout=180)
    assert inc["outcome"] == "recovered" and inc["evidence"]["host"] == head.name, inc
    assert chat(head) == 200

    # 4. the budget (3 restarts in the window) is spent: the next failure is recorded, nothing restarted
    _docker(worker.docker_host, "kill", engines(cluster, worker)[0]["Id"])
    inc = wait_incident(inv, 4)
    assert inc["outcome"] == "gave up", inc
    st = wait_state(inv, "failed")
    assert "deployctl up" in st["detail"], st
    time.sleep(3)
    assert not engines(cluster, worker)[0]["State"]["Running"], "nothing restarted after giving up"

    # 5. up starts it again (new containers: the budget is fresh)
    p = up(inv, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    wait_state(inv, "watching")
    # 6. MemAvailable under the floor for mem_sustain_s (a floor above this machine's memory): recorded
    #    with the figures, and acted on (the engines are not relaunched by the new settings: only the agents)
    p = up(inv, "--skip", "build", "--set", "supervise.mem_floor_gib=100000", "--set", "supervise.mem_sustain_s=2",
           timeout=300)
    assert p.returncode == 0, out(p)
    assert "launching" not in out(p), "a supervisor setting does not restart the engines"
    inc = wait_incident(inv, 5)
    assert inc["kind"] == "memory-low", inc
    ev = inc["evidence"]
    assert ev["floor_kib"] == 100000 * 1024 * 1024 and 0 < ev["mem_available_kib"] < ev["floor_kib"], ev
    assert all(v and v > 0 for v in inc["mem_available_gib"].values()), inc["mem_available_gib"]

    # 7. down removes every agent first, and nothing comes back
    p = dctl("down", "-i", str(inv), timeout=120)
    assert p.returncode == 0, out(p)
    time.sleep(3)
    for h in (head, worker):
        assert supervisors(cluster, h) == [] and engines(cluster, h) == [], f"{h.name}: left behind"
    _forget_releases(cluster, inv)


def names(cluster, host, deployment: str = DEP) -> dict[str, dict]:
    return {d["Name"].lstrip("/"): d for d in engines(cluster, host, deployment)}


def test_with_rollback_a_release_that_fails_for_good_gives_way_to_the_previous_one(cluster, hub, double_image,
                                                                                     tmp_path):
    """supervise.rollback: the up that replaces a serving release 1 keeps its containers, stopped, as
    <name>-prev on each host; release 2 serves, then crashes after every start: one restart, then the
    supervisor gives up and starts release 1's containers again, in up's order; it serves, recorded as
    release 3 (a rollback of 1). down removes the kept generation too."""
    head, worker = cluster.hosts[2], cluster.hosts[3]
    inv = inventory(cluster, hub, tmp_path, DEP, [head, worker], PORT, MASTER,
                    {"engine.image": DOUBLE_IMAGE, "engine.env.DOUBLE_LOAD_S": "1", "health.startup_timeout_s": 120,
                     "health.stay_up_s": 1, "supervise.interval_s": 1, "supervise.backoff_s": 1,
                     "supervise.max_restarts": 1, "supervise.window_s": 900, "supervise.rollback": True})
    _forget_releases(cluster, inv)
    for h in (head, worker):
        for d in supervisors(cluster, h) + engines(cluster, h):
            _docker(h.docker_host, "rm", "-f", d["Id"])
    p = up(inv, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    first = {h.name: names(cluster, h)["deployctl-sv2"]["Id"] for h in (head, worker)}
    wait_state(inv, "watching")

    seen = len(incidents(inv)["incidents"])            # an earlier test's, kept on the head after its down
    crash = ("--set", "engine.env.DOUBLE_FAIL=crash-later", "--set", "engine.env.DOUBLE_CRASH_AFTER_S=4")
    p = up(inv, "--skip", "build", *crash, "--json", timeout=300)
    assert p.returncode == 0, out(p)
    assert json.loads(p.stdout)["release"]["number"] == 2
    for h in (head, worker):
        kept = names(cluster, h)
        assert set(kept) == {"deployctl-sv2", "deployctl-sv2-prev"}, (h.name, sorted(kept))
        prev = kept["deployctl-sv2-prev"]
        assert prev["Id"] == first[h.name] and not prev["State"]["Running"], (h.name, prev["State"])
    st = json.loads(dctl("status", "-i", str(inv), "--json", timeout=60).stdout)
    assert [len(x["containers"]) for x in st["hosts"]] == [1, 1], "status counts the serving generation only"

    # release 2's first crash is restarted (or found while up still holds the lock: recorded, and
    # restarted at the next look), the next one spends the budget
    end, inc = time.monotonic() + 180, None
    while inc is None and time.monotonic() < end:
        time.sleep(1)
        inc = next((i for i in incidents(inv)["incidents"][seen:] if i["outcome"].startswith("gave up; ")), None)
    assert inc is not None, json.dumps(incidents(inv)["incidents"][seen:], indent=1)[-4000:]
    assert inc["outcome"] == "gave up; rolled back to release 1 (now release 3)", inc
    steps = [a["what"] for a in inc["actions"]]
    assert any(s.startswith("rolling back to release 1") for s in steps), steps
    assert [s for s in steps if s.startswith("starting")] == [f"starting {worker.name}", f"starting {head.name}"], steps
    st = wait_state(inv, "watching")
    assert "rolled back to release 1" in st["detail"], st
    p = dctl("status", "-i", str(inv), timeout=60)
    assert "Supervisor: watching (rolled back to release 1 (now release 3)" in " ".join(p.stdout.split()), out(p)
    for h in (head, worker):
        (c,) = names(cluster, h).values()
        assert c["Id"] == first[h.name] and c["Name"] == "/deployctl-sv2" and c["State"]["Running"], (h.name, c["State"])
        assert not any(e.startswith("DOUBLE_FAIL=") for e in c["Config"]["Env"]), "release 1's own settings"
    assert chat(head) == 200
    hist = json.loads(dctl("history", "-i", str(inv), "--json", timeout=60).stdout)["releases"]
    assert [(r["number"], r["rollback_of"], r["command"]) for r in hist][-1] == (3, 1, "supervisor"), hist
    assert hist[-1]["specs"] == hist[0]["specs"]

    p = dctl("down", "-i", str(inv), timeout=120)
    assert p.returncode == 0, out(p)
    for h in (head, worker):
        assert engines(cluster, h) == [], f"{h.name}: the kept generation left behind"
    _forget_releases(cluster, inv)
