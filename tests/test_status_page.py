"""#60 on the test cluster: the status page the head's supervisor serves, loaded in a real headless
Chromium (Debian's `chromium`, tests/browser.py), asserted on what it RENDERS. The engine double at TP=2
on node3-4 (the vllm-cpu recipe, as tests/test_supervisor.py), with an API key:

- without the key: the login form and nothing else, in the browser and over HTTP (401, no fact);
- the key once in the form: the deployment shows healthy, both ranks running, the controller's facts
  (the plan per node, the fabric check per link, the inventory) with their age;
- the worker's engine killed (docker kill): the page renders that rank down with its signal (SIGKILL)
  within a bound, then the deployment healthy again, and the incident in the timeline with its evidence;
- the worker's agent stopped: that host is shown as not answering, the deployment not healthy;
- `deployctl bench` pushes its plot, which the page shows; `status` names the page and `--exposure`
  lists its socket;
- `down`: the page's server is gone and the open page says it does not answer.
Screenshots are kept in a folder the test prints (DCTL_ARTIFACTS, else /tmp/deployctl-artifacts)."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.browser import Browser, executable
from tests.test_launch import _docker, containers, dctl, double_image, out, remove_all  # noqa: F401
from tests.test_real_vllm import DOUBLE_IMAGE, _forget_releases, hub, inventory, up  # noqa: F401

pytestmark = pytest.mark.cluster
DEP, PORT, MASTER, SUP_PORT, PAGE_PORT = "sp2", 18150, 29650, 18151, 18152
KEY = "sk-status-page-test-0123456789"
SEEN_DOWN_S = 8.0          # kill -> the page renders the rank down: agent report (1 s) + a poll (2 s) + slack
SILENT_S = 3


@pytest.fixture(autouse=True)
def leave_nothing(cluster):
    yield
    remove_all(cluster, DEP)


def artifacts() -> Path:
    d = Path(os.environ.get("DCTL_ARTIFACTS", "/tmp/deployctl-artifacts")) / "status-page" / time.strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    return d


def http(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def agent_id(host) -> str:
    return _docker(host.docker_host, "ps", "-aq", "--filter", f"label=deployctl.supervisor={DEP}").stdout.split()[0]


RECORD = """(() => {          // every state the worker's row and the verdict were rendered in, with the time
  window.__seen = [];
  const rec = () => {
    const row = document.querySelector('#ranks tr[data-host="%s"]');
    if (!row) return;
    const t = row.dataset.state + '|' + row.querySelector('td.state').innerText + '|' + document.getElementById('verdict').dataset.verdict;
    if (!__seen.length || __seen[__seen.length - 1].t !== t) __seen.push({at: Date.now(), t});
  };
  new MutationObserver(rec).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
  rec();
  return true;
})()"""


def test_the_status_page_in_a_real_browser(cluster, hub, double_image, tmp_path):
    if executable() is None:
        pytest.fail("no chromium on this machine: .ci/setup installs Debian's chromium")
    shots = artifacts()
    print(f"\n[status page] screenshots in {shots}")
    head, worker = cluster.hosts[2], cluster.hosts[3]
    (tmp_path / "api.key").write_text(KEY + "\n")
    inv = inventory(cluster, hub, tmp_path, DEP, [head, worker], PORT, MASTER,
                    {"engine.image": DOUBLE_IMAGE, "engine.env.DOUBLE_LOAD_S": "1", "health.startup_timeout_s": 120,
                     "supervise.interval_s": 1, "supervise.backoff_s": 1, "supervise.silent_s": SILENT_S,
                     "supervise.port": SUP_PORT, "supervise.page_port": PAGE_PORT},
                    api_key_file=str(tmp_path / "api.key"))
    _forget_releases(cluster, inv)
    t0 = time.monotonic()
    p = up(inv, "--skip", "build", timeout=300)
    assert p.returncode == 0, out(p)
    url = f"http://{head.address}:{PAGE_PORT}/"
    assert f"the status page on {url}" in " ".join(dctl("plan", "-i", str(inv), timeout=60).stdout.split()), \
        "the plan says where the page is"
    print(f"[status page] up in {time.monotonic() - t0:.1f}s; page {url}")

    # 1. no key: nothing but the login form
    code, body = http(url + "api/state")
    assert code == 401 and worker.name.encode() not in body, (code, body[:300])
    assert http(url + "api/state", "wrong-key")[0] == 401
    assert http(url + "api/state", KEY)[0] == 200
    with Browser() as b:
        pg = b.page(url)
        pg.wait("document.querySelector('form#login') !== null")
        text = pg.text()
        assert worker.name not in text and "tiny" not in text and "Hosts and ranks" not in text, text
        pg.screenshot(shots / "1-login.png")

        # 2. the key once: healthy, both ranks running, the controller's facts with their age
        pg.eval(f"document.getElementById('key').value = {json.dumps(KEY)}; document.getElementById('login').submit(); true")
        pg.wait("document.getElementById('verdict') && document.getElementById('verdict').dataset.verdict === 'healthy'", 60)
        assert pg.eval("[...document.querySelectorAll('#ranks tr[data-host]')].map(r => r.dataset.state).join()") == \
            "running,running"
        text = pg.text()
        assert f"{head.name} - {worker.name}" in text and "Gbit/s" in text, "the fabric check, per link"
        assert "plan pushed by the controller" in text and "checked" in text and DEP in text, text
        assert KEY not in text
        pg.screenshot(shots / "2-healthy.png")

        # 3. the worker's engine killed: rendered down with its signal within a bound, then healthy again
        pg.eval(RECORD % worker.name)
        (cid,) = containers(cluster, worker.name, DEP)
        killed_at = pg.eval("Date.now()")
        _docker(worker.docker_host, "kill", cid)
        seen = pg.wait("__seen.find(x => x.t.startsWith('down|') && x.t.includes('SIGKILL'))", SEEN_DOWN_S + 5, 0.05)
        pg.screenshot(shots / "3-rank-down.png")
        took = (seen["at"] - killed_at) / 1000
        assert took <= SEEN_DOWN_S, f"the killed rank was rendered down {took:.1f}s after the kill: {seen}"
        assert seen["t"].split("|")[2] in ("down", "recovering"), seen
        pg.wait("__seen.length && __seen[__seen.length - 1].t.startsWith('running|') && "
                "__seen[__seen.length - 1].t.endsWith('|healthy')", 90, 0.2)
        back = pg.eval("__seen[__seen.length - 1].at")
        # the incident in the timeline, opened to its evidence
        sel = "#s-incidents details[data-kind='rank-exited'][data-outcome='recovered']"
        pg.wait(f"document.querySelector(\"{sel}\") !== null", 30)
        pg.eval(f"document.querySelector(\"{sel}\").open = true; true")
        inc = pg.eval(f"document.querySelector(\"{sel}\").innerText")
        assert worker.name in inc and "SIGKILL" in inc and "stopping every rank" in inc, inc
        pg.screenshot(shots / "4-recovered-incident.png")
        print(f"[status page] kill -> rendered down in {took:.1f}s, healthy again {(back - killed_at) / 1000:.1f}s "
              f"after the kill; renders: {[x['t'] for x in pg.eval('__seen')]}")

        # 4. the worker's agent silent: that host is not answering, the deployment not healthy
        aid = agent_id(worker)
        _docker(worker.docker_host, "stop", "-t", "1", aid)
        t1 = time.monotonic()
        pg.wait(f"document.querySelector('#ranks tr[data-host=\"{worker.name}\"]').dataset.state === 'no-answer'",
                SILENT_S + 10)
        took_silent = time.monotonic() - t1
        assert pg.eval("document.getElementById('verdict').dataset.verdict") != "healthy"
        assert "no answer" in pg.text()
        pg.screenshot(shots / "5-host-not-answering.png")
        _docker(worker.docker_host, "start", aid)
        pg.wait("document.getElementById('verdict').dataset.verdict === 'healthy'", 30)
        print(f"[status page] agent stopped -> host shown not answering in {took_silent:.1f}s (silent_s {SILENT_S})")

        # 5. the last bench and its plot, pushed by `deployctl bench`
        p = dctl("bench", "-i", str(inv), "--concurrency", "1", "--rounds", "1", "--no-warmup",
                 "--input-tokens", "16", "--max-tokens", "4", timeout=120)
        assert p.returncode == 0 and f"status page {url} updated" in out(p), out(p)
        pg.wait("(() => { const i = document.querySelector('#s-bench img.plot'); return i && i.complete && i.naturalWidth > 0; })()", 15)
        pg.screenshot(shots / "6-bench.png")

        # 6. status --exposure lists it, as the status page, on the API's address
        p = dctl("status", "-i", str(inv), "--exposure", "--json", timeout=90)
        st = json.loads(p.stdout)
        assert st["status_page"] == url, "status names the page"
        socks = st["exposure"][head.name]["sockets"]
        page = [s for s in socks if s["port"] == PAGE_PORT]
        assert page and page[0]["serves"].startswith("the status page") and page[0]["address"] == head.address \
            and not page[0]["concern"], page or socks

        # 7. down: the page's server is gone, and the open page says so
        p = dctl("down", "-i", str(inv), timeout=120)
        assert p.returncode == 0, out(p)
        pg.wait("document.getElementById('verdict').dataset.verdict === 'no-answer'", 15)
        assert "does not answer" in pg.text()
        pg.screenshot(shots / "7-after-down.png")
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)
    _forget_releases(cluster, inv)
