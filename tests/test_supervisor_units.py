"""The supervisor's decisions and configuration, without a cluster (orchestrator/hostside/supervisor.py,
orchestrator/launch/supervision.py). The cluster tests are tests/test_supervisor.py and the TP=2 test of
tests/test_real_vllm.py."""
from __future__ import annotations

import json
import re
import struct
import threading
import time

from orchestrator.hostside import supervisor as S

CFG = {"deployment": "d", "mem_floor_kib": 2 * S.GiB_KIB, "mem_sustain_s": 30, "health_failures": 3,
       "api": {"url": "http://h:8000"}, "wedge": {"max_tokens": 4, "timeout_s": 60}}


def rank(host, status="running", finished="", exit_code=0, mem=8 * S.GiB_KIB, boot="b-" + "0" * 30):
    c = {"id": host + "-id", "name": f"deployctl-d-{host}", "status": status, "exit_code": exit_code,
         "oom_killed": False, "error": "", "finished_at": finished}
    return S.RankView(host, c, boot, mem)


def test_the_first_rank_to_stop_is_the_cause():
    d = S.Detector(CFG)
    ranks = {"h1": rank("h1", "exited", "2026-12-04T04:00:05.1Z", 1), "h2": rank("h2", "exited", "2026-12-04T04:00:03.9Z", 137)}
    f = d.observe(ranks, None, None, 0)
    assert f.kind == "rank-exited" and f.evidence["host"] == "h2" and f.act
    assert "exit code 137 (SIGKILL)" in f.summary and "then h1" in f.summary
    assert f.evidence["also_stopped"] == ["h1"]


def test_the_rank_whose_own_process_died_is_the_cause_even_when_the_head_stopped_first():
    """The released vLLM over two nodes (seen in CI): SIGKILL of the worker's VLLM::Worker_TP1; the head
    exits at 15.7 s, the worker's main process logs the death and exits at 16.3 s."""
    from orchestrator.launch import diagnosis
    cfg = {**CFG, "origin": [p.pattern for p in diagnosis.ORIGIN]}
    head = rank("h1", "exited", "2026-12-04T04:53:15.702262654Z", 0)
    head.log_tail = ["(APIServer pid=1) INFO 12-04 04:53:15 [core_client.py:770] [shutdown] MPClient: start timeout=0s"]
    worker = rank("h2", "exited", "2026-12-04T04:53:16.338201222Z", 0)
    worker.log_tail = ["(MainProcess pid=1) ERROR 12-04 04:53:14 [multiproc_executor.py:315] Worker proc VllmWorker-1 "
                       "died unexpectedly (exit code: None), shutting down executor."]
    f = S.Detector(cfg).observe({"h1": head, "h2": worker}, None, None, 0)
    assert f.evidence["host"] == "h2" and "then h1" in f.summary
    assert S.Detector(CFG).observe({"h1": head, "h2": worker}, None, None, 0).evidence["host"] == "h1", \
        "without the pattern: the first to stop"
    rows = [{"host": r.host, "rank": i, "containers": [{**r.container, "finished_at": float(i), "log_tail": r.log_tail}]}
            for i, r in enumerate((head, worker))]
    assert diagnosis.first_failure(rows)["host"] == "h2", "status names it the same way"


def test_a_removed_rank_is_not_restarted():
    ranks = {"h1": rank("h1"), "h2": S.RankView("h2", None)}
    f = S.Detector(CFG).observe(ranks, (True, "HTTP 200"), None, 0)
    assert f.kind == "rank-missing" and not f.act


def test_a_changed_boot_id_is_a_reboot():
    d = S.Detector(CFG)
    assert d.observe({"h1": rank("h1", boot="a" * 36)}, (True, ""), None, 0) is None
    f = d.observe({"h1": rank("h1", boot="b" * 36)}, (True, ""), None, 1)
    assert f.kind == "node-rebooted" and f.evidence["boot_id_before"] == "a" * 36
    assert d.observe({"h1": rank("h1", boot="b" * 36)}, (True, ""), None, 2) is None, "reported once"


def test_low_memory_counts_only_when_it_lasts():
    d = S.Detector(CFG)
    low = {"h1": rank("h1", mem=S.GiB_KIB)}
    assert d.observe(low, (True, ""), None, 100) is None
    assert d.observe(low, (True, ""), None, 129) is None
    assert d.observe({"h1": rank("h1")}, (True, ""), None, 130) is None, "recovered: the clock restarts"
    assert d.observe(low, (True, ""), None, 131) is None
    f = d.observe(low, (True, ""), None, 161)
    assert f.kind == "memory-low" and f.evidence["mem_available_kib"] == S.GiB_KIB


def test_health_must_fail_in_a_row_and_a_wedge_is_health_without_answers():
    d = S.Detector(CFG)
    r = {"h1": rank("h1")}
    assert d.observe(r, (False, "HTTP 503"), None, 0) is None
    assert d.observe(r, (False, "HTTP 503"), None, 1) is None
    assert d.observe(r, (True, "HTTP 200"), None, 2) is None, "an answer resets the count"
    for t in (3, 4):
        assert d.observe(r, (False, "timeout"), None, t) is None
    assert d.observe(r, (False, "timeout"), None, 5).kind == "health-failing"
    d.reset()
    f = d.observe(r, (True, "HTTP 200"), (False, "TimeoutError after 60.0s"), 6)
    assert f.kind == "wedge" and "did not finish within 60s" in f.summary
    f = d.observe(r, (True, "HTTP 200"), (False, 'HTTP 500: {"error": "EngineDeadError"}'), 7)
    assert f.kind == "serving-errors" and "EngineDeadError" in f.summary, "an answer with an error is not a wedge"


def test_secrets_are_masked_in_kept_lines():
    mask = S.masker(["sk-very-secret-value", "tok3n-abcdef"])
    assert mask("serve --api-key sk-very-secret-value --port 8000") == "serve --api-key *** --port 8000"
    assert mask("Authorization: Bearer tok3n-abcdef") == "Authorization: Bearer ***"
    assert mask("HF_TOKEN=hf_abcdefghijk") == "HF_TOKEN=***"
    assert mask("Loading weights took 3.1 s") == "Loading weights took 3.1 s"


def test_docker_log_frames_are_demultiplexed():
    raw = b"".join(struct.pack(">BxxxI", s, len(t)) + t for s, t in ((1, b"out line\n"), (2, b"err line\n")))
    assert S.demux(raw) == b"out line\nerr line\n"
    assert S.demux(b"a tty log\n") == b"a tty log\n"


def test_every_host_gets_one_install_and_no_secret(tmp_path):
    from orchestrator.launch import supervision
    from tests.test_exposure_units import _dep
    dep = _dep(tmp_path)
    cfgs = supervision.configs(dep)
    assert set(cfgs) == {h.name for h in dep.cluster.hosts}
    assert len({c["install"] for c in cfgs.values()}) == 1
    head = cfgs[dep.cluster.head]
    assert head["role"] == "head" and head["listen"] == dep.cluster.head_host.address
    assert head["origin"] and all(re.compile(p) for p in head["origin"]), "vLLM's own death line (diagnosis.ORIGIN)"
    assert head["workers"] == [h.name for h in dep.cluster.workers]
    from orchestrator.launch.containerspec import start_sequence
    assert [n for g in head["order"] for n in g] == [n for g in start_sequence(dep) for n in g], \
        "the group starts in up's order (its workers together: test_a_restart_starts_the_workers_together...)"
    assert sorted(n for g in head["order"] for n in g) == sorted(cfgs)
    for h in dep.cluster.workers:
        assert cfgs[h.name]["head_url"] == f"http://{dep.cluster.head_host.address}:{dep.recipe.supervise.port}"
    text = json.dumps(cfgs)
    assert "token" not in text.replace("max_tokens", ""), "the token travels in its own 0600 file"
    argv = supervision.run_argv(dep, dep.cluster.head_host, head["install"])
    assert argv[argv.index("--restart") + 1] == "unless-stopped" and "--network" in argv
    assert f"{supervision.LABEL}={dep.name}" in argv


def test_metrics_are_prometheus_text_that_promtool_accepts(tmp_path):
    """GET /metrics (Supervisor.metrics): one sample per rank and kind, labels escaped, counters kept per
    install across a restart of the supervisor, and Prometheus' own linter (promtool check metrics) passes."""
    import shutil
    import subprocess
    hist = tmp_path / "releases.json"
    hist.write_text(json.dumps({"releases": [{"number": 3, "time": 1764800000.5, "command": "up"}]}))
    cfg = {**CFG, "install": "i1", "host": "h1", "workers": ["h2"], "ranks": {"h1": 0, "h2": 1},
           "release_history": str(hist), "keep_incidents": 5}

    def sup():
        s = S.Supervisor(cfg, str(tmp_path), engine=None)
        s.local.view = lambda mask: S.RankView("h1", rank("h1").container, "b", 3 * S.GiB_KIB, 0.0, [], 10 ** 12)
        return s
    from orchestrator.launch.supervision import FABRIC_FILE, fabric_summary
    summary = fabric_summary({"at": 1764800000.25, "report": {"links": [
        {"a": "h1", "b": "h2", "throughput": {"gbps": 94.5}}, {"a": "h2", "b": "h1", "throughput": None}]}})
    assert summary == {"at": 1764800000.25, "links": [{"link": "h1-h2", "src": "h1", "dst": "h2", "gbps": 94.5}]}
    (tmp_path / FABRIC_FILE).write_text(json.dumps(summary))
    s = sup()
    s.sync({"host": "h2", "container": rank("h2", "exited", exit_code=137).container, "boot_id": "b",
            "mem_kib": None, "log_tail": [], "disk_avail": 5 * 10 ** 11})
    s.probe("health", (True, "HTTP 200"))
    s.probe("completion", (False, 'timed out "quoted"\nline'))
    s.restarts_total += 2
    s.incident(S.Finding("rank-exited", 'h2 exited "137"', {"host": "h2"}, True), s.views())
    text = s.metrics()
    lines = [x for x in text.splitlines() if not x.startswith("#")]
    assert 'deployctl_rank_running{deployment="d",host="h1",rank="0"} 1' in lines
    assert 'deployctl_rank_running{deployment="d",host="h2",rank="1"} 0' in lines
    assert 'deployctl_host_disk_avail_bytes{deployment="d",host="h2",rank="1"} 500000000000' in lines
    assert 'deployctl_host_mem_available_bytes{deployment="d",host="h1",rank="0"} 3221225472' in lines
    assert not [x for x in lines if x.startswith('deployctl_host_mem_available_bytes{deployment="d",host="h2"')], \
        "an unknown figure is no sample, not 0"
    assert 'deployctl_probe_ok{deployment="d",probe="completion"} 0' in lines
    assert 'deployctl_supervisor_state{deployment="d",state="watching"} 1' in lines
    assert 'deployctl_restarts_total{deployment="d"} 2' in lines
    assert 'deployctl_incidents_total{deployment="d",kind="rank-exited"} 1' in lines
    assert 'deployctl_incidents_total{deployment="d",kind="wedge"} 0' in lines
    assert 'deployctl_release_number{deployment="d",command="up"} 3' in lines
    assert 'deployctl_fabric_check_timestamp_seconds{deployment="d"} 1764800000.25' in lines
    assert 'deployctl_fabric_link_throughput_bytes{deployment="d",link="h1-h2",src="h1",dst="h2"} 11812500000' \
        in lines, "the link measured; the one without a figure has no sample"
    promtool = shutil.which("promtool")
    assert promtool, "Debian's prometheus (.ci/setup) provides promtool"
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    s.save_state()
    again = sup().metrics()
    assert 'deployctl_restarts_total{deployment="d"} 2' in again.splitlines()
    cfg["install"] = "i2"                         # a new install starts its counters again
    assert 'deployctl_restarts_total{deployment="d"} 0' in sup().metrics().splitlines()


def test_a_scrape_never_waits_on_the_docker_engine(tmp_path):
    """/metrics shows the head's rank as the loop last saw it: Docker's container list blocks while a
    container is being stopped (a restart), far past a scrape's timeout, so a scrape must not ask it."""
    cfg = {**CFG, "install": "i1", "host": "h1", "workers": [], "ranks": {"h1": 0},
           "release_history": str(tmp_path / "none.json")}
    s = S.Supervisor(cfg, str(tmp_path), engine=None)
    asked = []

    def view(mask):
        asked.append(1)
        return S.RankView("h1", rank("h1").container, "b", 3 * S.GiB_KIB, 0.0, [], 10 ** 12)
    s.local.view = view
    s.metrics()                                   # nothing seen yet: looked at once
    assert len(asked) == 1
    s.local.view = lambda mask: (_ for _ in ()).throw(AssertionError("a scrape asked the Docker engine"))
    time.sleep(0.05)
    lines = s.metrics().splitlines()
    assert 'deployctl_rank_running{deployment="d",host="h1",rank="0"} 1' in lines
    (age,) = [float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("deployctl_rank_report_age_seconds{")]
    assert age >= 0.05, "the head's sample says how old it is"


def test_the_rollback_target_is_the_release_the_kept_containers_are():
    """supervise.rollback: every rank's kept generation must carry one earlier release's spec, map the
    tables staged now, and that release must have served the checkpoint the nodes hold now."""
    ckpt = {"repo": "org/m", "commit": "c1"}
    hist = [{"number": 1, "specs": {"h1": "s1", "h2": "t1"}, "checkpoint": ckpt},
            {"number": 2, "specs": {"h1": "s2", "h2": "t2"}, "checkpoint": ckpt},
            {"number": 3, "specs": {"h1": "s3", "h2": "t3"}, "checkpoint": ckpt}]

    def ranks(kept, tables=("", "")):
        out = {}
        for (h, spec), tab in zip(kept.items(), tables):
            r = rank(h)
            r.container["tables"] = ""
            r.previous = None if spec is None else {"name": f"deployctl-d{S.PREVIOUS_SUFFIX}", "spec": spec, "tables": tab}
            out[h] = r
        return out
    target, why = S.rollback_target(hist, ranks({"h1": "s2", "h2": "t2"}))
    assert target["number"] == 2 and why == ""
    assert S.rollback_target(hist, ranks({"h1": "s2", "h2": None})) == (None, "no previous generation kept on h2")
    assert S.rollback_target(hist, ranks({"h1": "s2", "h2": "t1"}))[1] == "the kept containers are no earlier release's"
    assert S.rollback_target(hist, ranks({"h1": "s3", "h2": "t3"}))[0] is None, "the current release is no rollback"
    assert "tables staged on h2 changed" in S.rollback_target(hist, ranks({"h1": "s2", "h2": "t2"}, ("", "x")))[1]
    moved = [*hist[:2], {**hist[2], "checkpoint": {"repo": "org/m", "commit": "c2"}}]
    assert "another checkpoint" in S.rollback_target(moved, ranks({"h1": "s2", "h2": "t2"}))[1]
    assert S.rollback_target([], ranks({"h1": "s2", "h2": "t2"})) == (None, "no release history")


def test_the_suffixes_agree_with_launch():
    from orchestrator.launch import containers, containerspec
    assert S.PREVIOUS_SUFFIX == containers.PREVIOUS_SUFFIX and S.TABLES_LABEL == containerspec.TABLES_LABEL


def test_a_workers_rank_that_changes_state_wakes_the_loop_and_the_probe_runs_on_time(tmp_path):
    """The loop looks at once when a worker reports its rank started or stopped (not a tick later),
    and the completion probe runs when due (a wedge is seen within its interval + bound)."""
    cfg = {**CFG, "install": "i1", "host": "h1", "workers": ["h2"], "ranks": {"h1": 0, "h2": 1},
           "release_history": str(tmp_path / "none.json"), "interval_s": 2.0,
           "wedge": {**CFG["wedge"], "interval_s": 5.0}}
    s = S.Supervisor(cfg, str(tmp_path), engine=None)
    report = {"host": "h2", "container": {"id": "c2", "status": "running"}}
    s.sync(report)
    assert s.wake.is_set(), "the first report"
    s.wake.clear()
    s.sync(report)
    assert not s.wake.is_set(), "nothing changed"
    s.sync({**report, "container": {"id": "c2", "status": "exited"}})
    assert s.wake.is_set(), "the rank stopped"
    t0 = time.monotonic()
    s.pause()
    assert time.monotonic() - t0 < 0.1, "woken: no wait"
    s.state, s.last_wedge = "watching", time.monotonic() - 5.0 + 0.3
    t0 = time.monotonic()
    s.pause()
    assert 0.2 < time.monotonic() - t0 < 1.0, "the probe's due time, not the 2 s tick"
    s.last_wedge = time.monotonic() - 60          # overdue (no /health): the tick, not a busy loop
    threading.Timer(0.3, s.wake.set).start()
    t0 = time.monotonic()
    s.pause()
    assert 0.25 < time.monotonic() - t0 < 1.0


def test_a_restart_starts_the_workers_together_before_the_head():
    from orchestrator.deployment import load_deployment
    from orchestrator.launch.containerspec import start_sequence
    from orchestrator.launch.supervision import configs
    from orchestrator.paths import INVENTORIES_DIR
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    assert configs(dep)["spark1"]["order"] == [["spark4", "spark3", "spark2"], ["spark1"]]
    head_first = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.start_order=head-first",))
    assert configs(head_first)["spark1"]["order"] == [["spark1"], ["spark2", "spark3", "spark4"]]
    assert configs(dep)["spark1"]["order"] == [list(g) for g in start_sequence(dep)], "the order up starts in"
