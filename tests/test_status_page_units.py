"""The status page (#60) without a cluster: its server on 127.0.0.1 in front of a stand-in supervisor
(the attributes the head's supervisor has), asked over HTTP and rendered by the real headless Chromium;
where it listens and who the firewall admits (the controller's side); the facts the controller pushes.
The page on the test cluster, with a killed rank: tests/test_status_page.py."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator.hostside import metrics, status_page as P
from orchestrator.hostside.supervisor import RankView, exit_text, masker
from tests.browser import Browser

KEY = "sk-page-unit-key-0123456789"
NOW = time.time()


@dataclass
class FakeSup:
    """What status_page reads of the head's supervisor (hostside/supervisor.py Supervisor)."""
    dir: str
    key: str | None = KEY
    state: str = "watching"
    detail: str = ""
    restarts: list = field(default_factory=list)
    restarts_total: int = 1
    probes: dict = field(default_factory=lambda: {"health": (True, time.time()), "completion": (True, time.time())})
    ranks: dict = field(default_factory=dict)
    hist: list = field(default_factory=list)

    def __post_init__(self):
        self.cfg = {"deployment": "demo", "install": "abc123", "host": "node1", "workers": ["node2"],
                    "ranks": {"node1": 0, "node2": 1}, "silent_s": 15, "interval_s": 2, "max_restarts": 3,
                    "window_s": 900, "api": {"url": "http://127.0.0.1:9", "served_name": "tiny", "health_timeout_s": 10},
                    "page": {"listen": "127.0.0.1", "port": 0}}
        self.mask = masker([KEY])
        running = {"id": "c1", "name": "deployctl-demo", "status": "running", "exit_code": 0, "image": "sha256:" + "a" * 64}
        self.ranks = self.ranks or {"node1": RankView("node1", dict(running), "b1", 90 * 1024 * 1024, 0.2, [], 400 * 10 ** 9),
                                    "node2": RankView("node2", dict(running), "b2", 80 * 1024 * 1024, 0.7, [], 300 * 10 ** 9)}

    def views(self, cached: bool = False):
        return self.ranks

    def history(self):
        return self.hist


@pytest.fixture()
def served(tmp_path):
    sup = FakeSup(str(tmp_path))
    os.makedirs(tmp_path / "incidents")
    srv = P.start(sup, exit_text)
    assert srv is not None
    yield sup, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def get(url: str, headers: dict | None = None, data: bytes | None = None) -> tuple[int, dict, bytes]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_without_the_key_nothing_but_the_login_form(served):
    sup, base = served
    for path in ("/api/state", "/app.js", "/bench.png", "/logout"):
        code, _, body = get(base + path)
        assert code == 401 and b"node2" not in body and b"tiny" not in body, (path, code, body[:200])
    code, headers, body = get(base + "/")
    assert code == 401 and b'name="key"' in body and b"node1" not in body, body
    assert "no-store" in headers["Cache-Control"] and "default-src 'self'" in headers["Content-Security-Policy"]
    assert get(base + "/style.css")[0] == 200, "the login form's stylesheet (no fact in it)"
    assert get(base + "/api/state", {"Authorization": "Bearer wrong"})[0] == 401
    assert get(base + "/?key=wrong")[0] == 401
    code, _, body = get(base + "/api/state", {"Authorization": f"Bearer {KEY}"})
    doc = json.loads(body)
    assert code == 200 and doc["verdict"] == "healthy" and doc["key_required"], doc
    assert KEY not in body.decode()


def test_the_key_once_gives_a_cookie_that_is_not_the_key(served):
    sup, base = served
    code, headers, _ = get(base + "/login", data=f"key={KEY}".encode())
    assert code == 303 and headers["Location"] == "/", headers
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEY not in cookie, cookie
    value = cookie.split(";")[0]
    assert get(base + "/api/state", {"Cookie": value})[0] == 200
    code, headers, _ = get(base + f"/?key={KEY}")
    assert code == 303 and headers["Location"] == "/" and headers["Set-Cookie"].split(";")[0] == value, \
        "?key= lets in too, then drops the key from the address"
    assert get(base + "/login", data=b"key=nope")[0] == 401
    assert get(base + "/api/state", {"Cookie": value[:-2] + "00"})[0] == 401


def test_no_key_on_the_deployment_no_key_on_the_page(tmp_path):
    sup = FakeSup(str(tmp_path), key=None)
    srv = P.start(sup, exit_text)
    try:
        code, _, body = get(f"http://127.0.0.1:{srv.server_address[1]}/api/state")
        assert code == 200 and not json.loads(body)["key_required"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_silent_host_is_never_healthy_and_a_stopped_rank_is_down_with_its_signal(tmp_path):
    sup = FakeSup(str(tmp_path))
    page = P.Page(sup, exit_text)
    sup.ranks["node2"].age_s = 40
    doc = json.loads(page.build())
    assert doc["verdict"] == "unknown" and any("node2: no answer" in w for w in doc["why"]), doc
    row = next(r for r in doc["ranks"] if r["host"] == "node2")
    assert row["answering"] is False
    sup.ranks["node2"].age_s = 0.5
    sup.ranks["node2"].container.update(status="exited", exit_code=137)
    sup.ranks["node2"].log_tail = [f"--api-key {KEY}", "killed"]
    sup.probes["health"] = (False, time.time())
    page = P.Page(sup, exit_text)
    doc = json.loads(page.build())
    assert doc["verdict"] == "down" and "SIGKILL" in " ".join(doc["why"]), doc
    assert KEY not in json.dumps(doc), "secrets masked"
    sup.probes["health"] = (True, time.time() - 120)
    sup.ranks["node2"].container.update(status="running", exit_code=0)
    assert json.loads(P.Page(sup, exit_text).build())["verdict"] == "degraded", "a /health probe 2 min old is not health"


def test_in_flight_is_read_from_the_engines_metrics():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{model_name="m"} 5.0\nsglang:num_queue_reqs 1\n')
    assert metrics.in_flight(text) == {"running": 2, "waiting": 6}
    assert metrics.in_flight("nothing 1\n") is None


def _rich(sup: FakeSup, d: Path) -> None:
    """A deployment with an incident, releases and every pushed fact, as the page shows it."""
    inc = {"id": "20261207T031500Z-rank-exited", "time": NOW - 600, "time_text": "x", "kind": "rank-exited",
           "summary": "node2: deployctl-demo exited with exit code 137 (SIGKILL)", "outcome": "recovered",
           "recovery_s": 9.1, "evidence": {"host": "node2"}, "mem_available_gib": {"node1": 88.1, "node2": 79.0},
           "ranks": {"node2": {"exit": "exited with exit code 137 (SIGKILL)", "log_tail": ["boom", f"key {KEY}"],
                               "report_age_s": 0.4}},
           "actions": [{"t": 0, "what": "stopping every rank"}, {"t": 6.2, "what": "ready"}], "release": {"number": 2}}
    (d / "incidents" / f"{inc['id']}.json").write_text(json.dumps(inc))
    sup.hist = [{"number": n, "time": NOW - 3600 * (3 - n), "image": "vllm-dsv41:latest", "image_id": "sha256:" + f"{n}" * 64,
                 "command": "up", "checkpoint": {"repo": "deepseek-ai/x", "commit": "f" * 40}} for n in (1, 2)]
    (d / "page").mkdir()
    (d / "page" / "plan.json").write_text(json.dumps({"at": NOW - 3000, "hosts": {
        "node1": {"planned_bytes": 110 * 10 ** 9, "staging_need_bytes": 5 * 10 ** 9},
        "node2": {"planned_bytes": 110 * 10 ** 9, "staging_need_bytes": 500 * 10 ** 9}}}))
    (d / "page" / "fabric.json").write_text(json.dumps({"at": NOW - 3000, "topology": "switch", "links": [
        {"a": "node1", "b": "node2", "gbps": 98.4, "mtu": 9000, "rtt_ms": 0.05, "ok": True}]}))
    (d / "page" / "inventory.json").write_text(json.dumps({"at": NOW - 3000, "deployments": [
        {"name": "demo", "model": "tiny", "hosts": ["node1", "node2"], "page_url": "http://10.0.0.1:8890/"},
        {"name": "small", "model": "qwen", "hosts": ["node3"], "page_url": "http://10.0.0.3:8891/"}],
        "router": {"url": "http://127.0.0.1:9", "host": "node1", "routes": [{"model": "tiny", "deployment": "demo"}]}}))


def test_the_page_renders_in_a_real_browser(served, tmp_path):
    sup, base = served
    _rich(sup, Path(sup.dir))
    with Browser() as b:
        p = b.page(base + "/")
        assert p.eval("document.querySelector('form#login') !== null")
        assert "node2" not in p.text()
        p.eval(f"document.getElementById('key').value = {json.dumps(KEY)}; document.getElementById('login').submit(); true")
        p.wait("document.body.dataset.rendered")
        assert p.eval("document.getElementById('verdict').dataset.verdict") == "healthy"
        text = p.text()
        for want in ("node1 - node2", "98.40 Gbit/s", "9000", "release 1: image vllm-dsv41",
                     "small", "http://10.0.0.3:8891/", "rank-exited", "recovered", "staging needs 500.0 GB"):
            assert want in text, (want, text)
        assert KEY not in text
        p.eval("document.querySelector('#s-incidents details').open = true; true")
        assert "SIGKILL" in p.text() and "boom" in p.text()
        shot = p.screenshot(tmp_path / "unit-page.png")
        sup.key = "another-key"          # a changed key voids the cookie: 401, and the page shows the login form
        p.wait("document.querySelector('form#login') !== null", timeout=10)
    print(f"\n[status page] screenshot: {shot}")


def test_a_page_whose_server_stops_answering_says_so(tmp_path):
    sup = FakeSup(str(tmp_path), key=None)
    os.makedirs(tmp_path / "incidents")
    srv = P.start(sup, exit_text)
    base = f"http://127.0.0.1:{srv.server_address[1]}/"
    with Browser() as b:
        p = b.page(base)
        p.wait("document.getElementById('verdict').dataset.verdict === 'healthy'")
        srv.shutdown()
        srv.server_close()
        p.wait("document.getElementById('verdict').dataset.verdict === 'no-answer'", timeout=10)
        assert "does not answer" in p.text()


# ------------------------------------------------------------------------------- the controller's side

def test_the_page_listens_and_is_admitted_like_the_api(tmp_path):
    from orchestrator.launch import exposure as E
    from orchestrator.launch import firewall as F
    from orchestrator.launch import status_page as S
    from orchestrator.launch import supervision
    from tests.test_exposure_units import _dep
    dep = _dep(tmp_path)
    head = dep.cluster.head_host
    page = dep.recipe.supervise.port + 100
    assert S.port(dep) == page and S.url(dep) == f"http://{head.address}:{page}/"
    assert supervision.configs(dep)[head.name]["page"] == {"listen": head.address, "port": page,
                                                           "url": S.url(dep), "key": False}
    assert all("page" not in c for n, c in supervision.configs(dep).items() if n != head.name)
    v4 = F.ruleset(dep, head).v4.splitlines()
    assert f"-A {F.chain_name(dep.name)} -p tcp --dport {page} -j RETURN" in v4, "without api_allow: as the API"
    allowed = _dep(tmp_path, "    api_allow: [192.0.2.200]\n")
    v4 = F.ruleset(allowed, allowed.cluster.head_host).v4.splitlines()
    assert [ln for ln in v4 if f"--dport {page} " in ln] == [
        f"-A {F.chain_name(dep.name)} -p tcp --dport {page} -s 192.0.2.200/32 -j RETURN",
        f"-A {F.chain_name(dep.name)} -p tcp --dport {page} -j REJECT --reject-with tcp-reset"], "api_allow: as the API"
    s = E.classify(E.Socket("tcp", head.address, page, "python3", 1), head, {}, dep.api_port, [], "", (8790,), (page,))
    assert not s.concern and s.scope == "management"
    wide = _dep(tmp_path, "    api_listen: 0.0.0.0\n")
    assert S.url(wide) == f"http://{head.address}:{page}/" and supervision.page_config(wide)["listen"] == "0.0.0.0"
    from orchestrator.deployment import load_deployment
    off = load_deployment(tmp_path / "fw.yml", sets=("supervise.page=false",))
    assert S.port(off) is None and supervision.configs(off)[head.name]["page"] is None
    assert f"--dport {page} " not in F.ruleset(off, head).v4


def test_a_page_port_taken_is_refused_before_anything_runs(tmp_path):
    from orchestrator.errors import InputError
    from orchestrator.deployment import load_deployment
    from tests.test_exposure_units import _dep
    _dep(tmp_path)
    with pytest.raises(InputError, match="cannot share port"):
        load_deployment(tmp_path / "fw.yml", sets=("supervise.page_port=8790",))


def test_the_controllers_facts(tmp_path):
    from orchestrator.launch import status_page as S
    from tests.test_exposure_units import _dep
    dep = _dep(tmp_path)
    plan = S.plan_facts(dep, now=123.0)
    assert plan["at"] == 123.0 and set(plan["hosts"]) == {h.name for h in dep.cluster.hosts}
    assert all(v["planned_bytes"] and v["planned_bytes"] > 0 for v in plan["hosts"].values()), plan
    fab = S.fabric_facts({"at": 99.0, "report": {"topology": "switch", "links": [
        {"a": "s1", "b": "s2", "reach": {"a>b": True, "b>a": True}, "df": {"a>b": True}, "mtu": 9000, "rtt_ms": 0.1,
         "throughput": {"gbps": 97.5, "retransmits": 0, "error": None}, "expected_gbps": 100, "detail": {}},
        {"a": "s1", "b": "s3", "reach": {"a>b": False}, "df": {}, "mtu": 9000, "rtt_ms": None, "throughput": None,
         "expected_gbps": 100, "detail": {"reach": "no reply"}}]}})
    assert fab["at"] == 99.0 and [(x["a"], x["b"], x["gbps"], x["mtu"], x["ok"]) for x in fab["links"]] == \
        [("s1", "s2", 97.5, 9000, True), ("s1", "s3", None, 9000, False)] and fab["links"][1]["detail"] == "reach: no reply"
    assert S.fabric_facts(None) is None
    inv = S.inventory_facts(dep, now=5.0)
    assert inv["deployments"] == [{"name": dep.name, "model": dep.recipe.engine.served_name, "hosts": [h.name for h in dep.cluster.hosts],
                                   "head": dep.cluster.head, "api_url": dep.api_url, "page_url": S.url(dep)}]
    b = S.bench_facts({"levels": [{"concurrency": 1, "ttft_ms": 50.0, "tps": 40.0, "itl_ms": 9.0, "errors": 0}],
                       "verdicts": [{"concurrency": 1, "meets_slo": True}], "max_c": 1, "config": {"url": "u", "model": "m"}}, now=7.0)
    assert b == {"at": 7.0, "max_c": 1, "levels": [{"concurrency": 1, "ttft_ms": 50.0, "tps": 40.0, "itl_ms": 9.0,
                                                     "errors": 0, "meets_slo": True}], "url": "u", "model": "m", "ok": None}


def test_the_assets_travel_in_the_zipapp(tmp_path):
    import subprocess
    import sys
    import zipfile
    from orchestrator.hostside import bundle
    z = bundle.build(tmp_path)
    names = zipfile.ZipFile(z).namelist()
    for a in ("index.html", "login.html", "app.js", "style.css"):
        assert f"orchestrator/hostside/page/{a}" in names
    code = "import sys; sys.path.insert(0, sys.argv[1]); from orchestrator.hostside import status_page as P; print(len(P.asset('app.js')))"
    p = subprocess.run([sys.executable, "-c", code, str(z)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and int(p.stdout) > 1000, p.stderr
