"""Issue #14 (hardening): bad values are refused at load time, exit 2, naming the file and key they
came from (the recipe file, the inventory's key, or --set); run records stay inside run_dir; a
host-side op killed by a signal says which signal and why. No host, no cluster, no Docker."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator import checks
from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.imagechain.spec import CHAINS_DIR, load_chain
from orchestrator.inventory import load_inventory
from orchestrator.paths import INVENTORIES_DIR, RECIPES_DIR
from orchestrator.recipe import load_recipe
from orchestrator.runrecord import new_run_dir
from orchestrator.signals import describe_exit, exit_text, signal_of

ROOT = Path(__file__).resolve().parent.parent
SPARK4 = INVENTORIES_DIR / "spark4.yml"

# 192.0.2.0/24 is TEST-NET-1 (RFC 5737): nothing answers there, should a check ever let one through.
INV = textwrap.dedent("""\
    all:
      vars:
        recipe: deepseek-v41-flash-tp4
        head: s1
      hosts:
        s1: {ansible_host: 192.0.2.1, rank: 0, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
        s2: {ansible_host: 192.0.2.2, rank: 1, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
        s3: {ansible_host: 192.0.2.3, rank: 2, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
        s4: {ansible_host: 192.0.2.4, rank: 3, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
    """)


def inventory(tmp_path: Path, edit=None, name: str = "inv.yml") -> Path:
    doc = yaml.safe_load(INV)
    if edit:
        edit(doc)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def refused(fn, *args, **kw) -> InputError:
    with pytest.raises(InputError) as e:
        fn(*args, **kw)
    assert e.value.exit_code == 2
    return e.value


# -- the reported values, through --set: refused at load, blamed on --set ------------------------------

@pytest.mark.parametrize("expr, key, needle", [
    ("engine.shm_size=abc", "engine.shm_size", "docker memory size"),
    ("engine.shm_size=-1g", "engine.shm_size", "docker memory size"),
    ("engine.memory_limit=12q", "engine.memory_limit", "docker memory size"),
    ("engine.memory_swap=-2", "engine.memory_swap", "docker memory size"),
    ("engine.port=0", "engine.port", "1..65535"),
    ("engine.port=-1", "engine.port", "1..65535"),
    ("engine.port=70000", "engine.port", "1..65535"),
    ("engine.master_port=-5", "engine.master_port", "1..65535"),
    ("health.startup_timeout_s=-1", "health.startup_timeout_s", "must be > 0, got -1"),
    ("health.startup_timeout_s=0", "health.startup_timeout_s", "must be > 0"),
    ("health.poll_interval_s=0", "health.poll_interval_s", "must be > 0"),
    ("health.request_timeout_s=-3", "health.request_timeout_s", "must be > 0"),
    ("engram.free_margin_gb=-1", "engram.free_margin_gb", "must be >= 0"),
    ("engram.geometry.vocab_per_order=[0,0,0]", "engram.geometry.vocab_per_order[0]", ">= 1"),
    ("engram.geometry.vocab_per_order=[16000000,-5,16000000]", "engram.geometry.vocab_per_order[1]", ">= 1"),
    ("bench.rounds=0", "bench.rounds", ">= 1"),
    ("bench.concurrency=[1,0]", "bench.concurrency[1]", ">= 1"),
    ("engine.args.max-num-seqs=-8", "engine.args.max-num-seqs", "count or size"),
    ("engine.args.max-model-len=0", "engine.args.max-model-len", "count or size"),
    ("engine.args.block-size=-128", "engine.args.block-size", "count or size"),
    ("engine.args.max-num-batched-tokens='-1'", "engine.args.max-num-batched-tokens", "count or size"),
    ("parallelism.gpus_per_node=0", "parallelism.gpus_per_node", ">= 1"),
    ("engine.image=Vllm-DSV41:latest", "engine.image", "image reference"),
    ("engine.image=vllm dsv41", "engine.image", "image reference"),
    ("engine.image=vllm-dsv41@sha256:abc", "engine.image", "image reference"),
    ("engine.container_name=a/b", "engine.container_name", "container-name rule"),
    ('engine.cache_dir="/var/tmp/x\\ny"', "engine.cache_dir", "control character '\\n'"),
    ("engram.subdir=../../etc", "engram.subdir", "relative folder"),
    ("model.checkpoint_dir=/abs", "model.checkpoint_dir", "relative folder"),
    ("model.revision=../../x", "model.revision", "relative folder"),
    ("model.repo=org/../x", "model.repo", "Hugging Face repo id"),
])
def test_bad_set_value_is_refused_and_blamed_on_set(expr, key, needle):
    e = refused(load_deployment, SPARK4, None, (expr,))
    assert (e.file, e.key) == ("--set", key), str(e)
    assert needle in e.detail
    assert str(e).startswith(f"--set: {key}: ")


def test_ple_counts_and_sglang_switches():
    e = refused(load_recipe, "qwen38-flash-next-spark", ["ple.shards=0"])
    assert e.key == "ple.shards"
    # documented switches of the released engines pass (checks.ARG_SWITCHES) ...
    load_recipe("qwen38-flash-next-spark", ["engine.args.chunked-prefill-size=-1"])
    load_recipe("deepseek-v41-flash-tp4", ["engine.args.max-model-len=-1"])
    # ... but only for the engine that documents them
    assert refused(load_recipe, "deepseek-v41-flash-tp4", ["engine.args.chunked-prefill-size=-1"]).key == \
        "engine.args.chunked-prefill-size"


@pytest.mark.parametrize("expr", [
    "engine.shm_size=1g", "engine.shm_size=1.5GiB", "engine.shm_size=512M", "engine.shm_size=2 gb",
    "engine.shm_size=1073741824", "engine.shm_size=10b", "engine.memory_swap=-1",
    "engine.image=localhost:5000/team/vllm-dsv41:v1.2_rc-3",
    "engine.image=registry.example.com/a__b/c--d@sha256:" + "0" * 64,
    "engine.image=vllm/vllm-openai:nightly-8a72@sha256:" + "ab" * 32,
    "engine.container_name=dsv41.head_1", "engine.args.max-num-seqs=4", "engine.args.max-model-len=300k",
    "engram.free_margin_gb=0", "engram.subdir=engram/rows", "model.revision=refs/pr/1",
])
def test_good_values_still_load(expr):
    load_deployment(SPARK4, None, (expr,))


# -- values in the recipe file are blamed on the recipe file, with the line ---------------------------

def test_bad_value_in_recipe_file_names_the_file_and_line(tmp_path):
    text = (RECIPES_DIR / "deepseek-v41-flash-tp4.yml").read_text().replace("shm_size: 32g", "shm_size: abc")
    p = tmp_path / "r.yml"
    p.write_text(text)
    e = refused(load_recipe, str(p))
    assert (e.file, e.key) == (str(p), "engine.shm_size")
    assert text.splitlines()[e.line - 1].strip().startswith("shm_size: abc")


def test_an_override_elsewhere_does_not_take_the_blame(tmp_path):
    text = (RECIPES_DIR / "deepseek-v41-flash-tp4.yml").read_text().replace("port: 8000", "port: 0")
    p = tmp_path / "r.yml"
    p.write_text(text)
    e = refused(load_recipe, str(p), ["engine.master_port=29600", "engine.args.max-num-seqs=4"])
    assert (e.file, e.key) == (str(p), "engine.port")


# -- recipe_overrides: blamed on the inventory and its key --------------------------------------------

def _overrides(values):
    return lambda d: d["all"]["vars"].__setitem__("recipe_overrides", values)


@pytest.mark.parametrize("values, key, needle", [
    ({"engine.shm_size": "abc"}, "all.vars.recipe_overrides.engine.shm_size", "docker memory size"),
    ({"health.poll_interval_s": 0}, "all.vars.recipe_overrides.health.poll_interval_s", "> 0"),
    ({"engram.placment": "memory"}, "all.vars.recipe_overrides.engram.placment", "unknown key 'placment'"),
    ({"engine.args": {"max-num-seqs": -8}}, "all.vars.recipe_overrides.engine.args.max-num-seqs",
     "count or size"),
    ({"engine.port.x": 1}, "all.vars.recipe_overrides.engine.port.x", "engine.port is not a mapping"),
    ({"engram.geometry.vocab_per_order": [0, 0, 0]},
     "all.vars.recipe_overrides.engram.geometry.vocab_per_order[0]", ">= 1"),
])
def test_bad_recipe_override_names_the_inventory_and_key(tmp_path, values, key, needle):
    p = inventory(tmp_path, _overrides(values))
    e = refused(load_deployment, p)
    assert (e.file, e.key) == (str(p), key), str(e)
    assert needle in e.detail and e.line is not None
    assert list(values)[0] in p.read_text().splitlines()[e.line - 1]


def test_set_wins_over_the_inventory_and_takes_the_blame(tmp_path):
    p = inventory(tmp_path, _overrides({"engine.port": 0}))
    assert load_deployment(p, None, ("engine.port=8001",)).recipe.engine.port == 8001    # replaced: fine
    p = inventory(tmp_path, _overrides({"engine.port": 8001}))
    e = refused(load_deployment, p, None, ("engine.port=0",))
    assert (e.file, e.key) == ("--set", "engine.port")
    # a whole mapping set later replaces what an earlier override set below it
    p = inventory(tmp_path, _overrides({"engine.args.max-num-seqs": 4}))
    e = refused(load_deployment, p, None, ("engine.args={max-num-seqs: -1}",))
    assert (e.file, e.key) == ("--set", "engine.args.max-num-seqs")


def test_unknown_recipe_in_the_inventory_names_the_inventory(tmp_path):
    p = inventory(tmp_path, lambda d: d["all"]["vars"].__setitem__("recipe", "no-such-recipe"))
    e = refused(load_deployment, p)
    assert (e.file, e.key) == (str(p), "all.vars.recipe") and "no recipe named 'no-such-recipe'" in e.detail
    p = inventory(tmp_path, lambda d: d["all"]["vars"].__setitem__("recipe", "missing.yml"))
    e = refused(load_deployment, p)
    assert (e.file, e.key) == (str(p), "all.vars.recipe") and "missing.yml" in e.detail
    # --recipe is still blamed on --recipe
    assert refused(load_deployment, p, "no-such-recipe").key == "--recipe"


# -- inventory values --------------------------------------------------------------------------------

def _host(var, value, host="s2"):
    return lambda d: d["all"]["hosts"][host].__setitem__(var, value)


def _var(var, value):
    return lambda d: d["all"]["vars"].__setitem__(var, value)


@pytest.mark.parametrize("edit, key, needle", [
    (_host("ansible_port", -22), "all.hosts.s2.ansible_port", "1..65535"),
    (_host("ansible_port", 0), "all.hosts.s2.ansible_port", "1..65535"),
    (_host("ansible_port", 70000), "all.hosts.s2.ansible_port", "1..65535"),
    (_host("model_cache", "/m\nx"), "all.hosts.s2.model_cache", "control character '\\n'"),
    (_host("nvme_dir", "/n\tx"), "all.hosts.s2.nvme_dir", "control character '\\t'"),
    (_host("nvme_dir", "/n\x00x"), "all.hosts.s2.nvme_dir", "control character"),
    (_host("nvme_dir", ""), "all.hosts.s2.nvme_dir", "folder path"),
    (_host("docker_host", "unix:///x\n.sock"), "all.hosts.s2.docker_host", "control character"),
    (_var("run_dir", "runs\nx"), "all.vars.run_dir", "control character"),
    (_var("known_hosts_file", "/k\x7f"), "all.vars.known_hosts_file", "control character"),
    (_var("deployment", "../../../../tmp/X"), "all.vars.deployment", "container-name rule"),
    (_var("deployment", "a;b"), "all.vars.deployment", "container-name rule"),
    (_var("deployment", "a/b"), "all.vars.deployment", "container-name rule"),
    (_var("deployment", "a..b"), "all.vars.deployment", "'..'"),
    (_var("deployment", "-x"), "all.vars.deployment", "container-name rule"),
])
def test_bad_inventory_value_names_the_key(tmp_path, edit, key, needle):
    p = inventory(tmp_path, edit)
    e = refused(load_inventory, p)
    assert (e.file, e.key) == (str(p), key), str(e)
    assert needle in e.detail and e.line is not None


def test_a_host_name_that_climbs_out_is_refused(tmp_path):
    p = inventory(tmp_path, lambda d: d["all"]["hosts"].__setitem__("../evil", d["all"]["hosts"].pop("s4")))
    e = refused(load_inventory, p)
    assert e.key == "all.hosts.../evil" and "container-name rule" in e.detail


def test_default_deployment_name_is_the_file_stem_and_checked(tmp_path):
    assert load_inventory(inventory(tmp_path, name="lab-2.yml")).name == "lab-2"
    e = refused(load_inventory, inventory(tmp_path, name="my lab.yml"))
    assert e.key == "all.vars.deployment" and "this file's stem" in e.detail


def test_run_dirs_stay_inside_run_dir(tmp_path):
    p = new_run_dir(tmp_path / "runs", "spark4", "up")
    assert p.parent == tmp_path / "runs"
    for bad in ("../../x", "a/b", "..", "a\0b"):
        refused(new_run_dir, tmp_path / "runs", bad, "plan-check")
    assert [x.name for x in (tmp_path / "runs").iterdir()] == [p.name]


# -- the grammars themselves -------------------------------------------------------------------------

@pytest.mark.parametrize("v, ok", [
    ("64g", True), ("64G", True), ("1.5GiB", True), ("2 gb", True), ("512m", True), ("10b", True),
    ("100", True), ("7kib", True), ("3P", True), ("1 ", True),          # go-units drops one space
    ("abc", False), ("-1g", False), ("1.2.3g", False), ("1gibb", False), ("1x", False), ("", False),
    (" 1g", False), ("g", False), ("1e3", False), ("1ib", False), ("1  g", False),
])
def test_docker_size_grammar(v, ok):
    if ok:
        checks.docker_size(v, "f", "k")
    else:
        refused(checks.docker_size, v, "f", "k")


@pytest.mark.parametrize("v, ok", [
    ("vllm-dsv41:latest", True), ("dctl-engine:test", True), ("lmsysorg/sglang:latest", True),
    ("ubuntu", True), ("a.b_c__d---e/f", True), ("localhost:5000/x/y:Tag_1.0-rc", True),
    ("[::1]:5000/img:t", True), ("img@sha256:" + "f" * 64, True), ("img@sha512:" + "a" * 128, True),
    ("Img:t", False), ("img:", False), ("img:-t", False), ("img:" + "t" * 129, False), ("a_-b", False),
    ("img@sha256:" + "F" * 64, False), ("img@sha256:" + "f" * 63, False), ("/img", False), ("img/", False),
    ("img;rm -rf /", False), ("a" * 256, False),
])
def test_image_reference_grammar(v, ok):
    if ok:
        checks.image_ref(v, "f", "k")
    else:
        refused(checks.image_ref, v, "f", "k")


@pytest.mark.parametrize("v, ok", [
    ("spark4", True), ("a", True), ("Lab_2.x-y", True), ("192.0.2.1", True),
    ("", False), ("_a", False), (".a", False), ("a b", False), ("a/b", False), ("a..b", False), ("ä", False),
])
def test_name_grammar(v, ok):
    if ok:
        checks.name(v, "f", "k")
    else:
        refused(checks.name, v, "f", "k")


def test_every_shipped_recipe_inventory_and_chain_still_loads():
    for p in sorted(RECIPES_DIR.glob("*.yml")):
        load_recipe(str(p))
    invs = sorted(INVENTORIES_DIR.glob("*.yml"))
    assert len(invs) >= 6
    for p in invs:
        load_deployment(p)
    for p in sorted(CHAINS_DIR.glob("*.yml")):
        if not p.stem.endswith(".lock"):
            load_chain(p.stem)


# -- the CLI: exit 2, the message, nothing written -----------------------------------------------------

def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python3 -m orchestrator` from this checkout (not the installed deployctl), in tmp_path."""
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("args, needle", [
    (["plan", "--set", "engine.shm_size=abc"], "--set: engine.shm_size: expected a docker memory size"),
    (["plan", "--check", "--set", "engine.port=70000"], "--set: engine.port: expected a TCP port 1..65535"),
    (["up", "--dry-run", "--set", "bench.rounds=0"], "--set: bench.rounds: must be a whole number >= 1"),
    (["up", "--set", "health.poll_interval_s=0"], "--set: health.poll_interval_s: must be > 0"),
])
def test_cli_refuses_a_bad_set_and_writes_nothing(tmp_path, args, needle):
    inv = inventory(tmp_path, _var("run_dir", str(tmp_path / "runs")))
    p = cli(tmp_path, args[0], "-i", str(inv), *args[1:])
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["inv.yml"]


def test_cli_refuses_a_climbing_deployment_name_and_writes_nothing(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    inv = inventory(tmp_path / "a" / "b", _var("deployment", "../../escaped"))   # runs/ is in tmp_path
    p = cli(tmp_path, "plan", "--check", "-i", str(inv))
    assert p.returncode == 2, p.stderr
    assert f"{inv}:" in p.stderr and "all.vars.deployment" in p.stderr
    assert sorted(str(x.relative_to(tmp_path)) for x in tmp_path.rglob("*")) == ["a", "a/b", "a/b/inv.yml"]


def test_cli_names_the_inventory_for_its_recipe_override(tmp_path):
    inv = inventory(tmp_path, _overrides({"engine.shm_size": "abc"}))
    p = cli(tmp_path, "up", "--dry-run", "-i", str(inv))
    assert p.returncode == 2
    assert f"{inv}:" in p.stderr and "all.vars.recipe_overrides.engine.shm_size" in p.stderr


# -- signals: one decoder, used by every host-side result ----------------------------------------------

@pytest.mark.parametrize("rc, kw, needles", [
    (137, {}, ["killed by SIGKILL (rc 137)", "OOM killer", "dmesg", "operator's kill"]),
    (-9, {}, ["killed by SIGKILL (rc -9)", "OOM killer"]),
    (143, {}, ["killed by SIGTERM (rc 143)", "shutdown or an operator"]),
    (-15, {}, ["SIGTERM (rc -15)"]),
    (139, {}, ["SIGSEGV", "segmentation fault"]),
    (135, {}, ["SIGBUS", "bus error"]),
    (134, {}, ["SIGABRT"]),
    (130, {}, ["SIGINT"]),
    (124, {"time_limit_s": 600}, ["did not finish within 600 s", "`timeout`", "rc 124"]),
    (137, {"time_limit_s": 600}, ["SIGKILL (rc 137)", "time limit of 600 s", "`timeout -k`", "dmesg"]),
    (-9, {"time_limit_s": 90.5}, ["time limit of 90.5 s"]),
    (-1, {"ssh": True}, ["killed by a signal", "rc -1", "OOM killer"]),
    (-1, {"ssh": True, "time_limit_s": 60}, ["60 s", "timeout -k", "dmesg"]),
    (-1, {}, ["SIGHUP"]),                        # subprocess's -1 is SIGHUP; only paramiko's is "unknown"
])
def test_describe_exit(rc, kw, needles):
    text = describe_exit(rc, **kw)
    for n in needles:
        assert n in text, text


@pytest.mark.parametrize("rc", [None, 0, 1, 2, 30, 124, 125, 126, 127, 128, 255, 200])
def test_ordinary_exit_codes_are_not_signals(rc):
    assert describe_exit(rc) is None and (rc is None or signal_of(rc) is None)
    if rc is not None:
        assert exit_text(rc) == f"exited {rc}"


def test_table_op_killed_says_which_signal():
    from orchestrator.executors.ansible import PlaybookHostResult
    from orchestrator.stages.tableop import TableJob, host_result
    job = TableJob("s1", "engram-stage", "/n/.deployctl", "/n/p.pyz", "/n/s.json", {}, ("python3",), 0, 700)
    for rc, needle in ((137, "was killed by SIGKILL (rc 137): its time limit of 700 s"),
                       (-9, "SIGKILL (rc -9)"), (124, "did not finish within 700 s on the host"),
                       (-11, "was killed by SIGSEGV")):
        r = host_result("stage-engram", job, PlaybookHostResult("s1", False, rc, "non-zero return code"),
                        lambda j, d: None)
        assert r.status == "failed" and r.message.startswith("engram-stage "), r.message
        assert needle in r.message, r.message
    r = host_result("stage-engram", job, PlaybookHostResult("s1", False, 1, "non-zero return code"),
                    lambda j, d: None)
    assert r.message == "non-zero return code"


def test_ansible_task_killed_says_which_signal():
    from orchestrator.executors.ansible import _HostState, _host_result
    st = _HostState("s1")
    st.failed = {"task": "Stage", "json": None,
                 "res": {"rc": -9, "msg": "non-zero return code", "stderr": "loading rows\n"}}
    r = _host_result(st, "failed", 2, 60, {})
    assert r.rc == -9 and "killed by SIGKILL (rc -9)" in r.msg and "non-zero return code" not in r.msg
    assert r.msg.endswith("its last stderr line: loading rows")


def test_rsync_ship_and_modelsync_name_the_signal():
    from orchestrator.modelsync.rsync import explain as rsync_explain
    from orchestrator.ship.transfer import explain as ship_explain
    msg = rsync_explain(-1, "", "w1", "192.0.2.2", "/m", 60, 900)
    assert "killed by a signal" in msg and "900 s" in msg and "re-run to resume" in msg
    assert "did not finish within 900s" in rsync_explain(124, "", "w1", "192.0.2.2", "/m", 60, 900)
    assert "docker load was killed by SIGKILL (rc -9)" in ship_explain("w1", {"rc": -9})
    assert ship_explain("w1", {"rc": 1}) == "docker load exited 1"
    assert "; it was killed by SIGTERM" in ship_explain("w1", {"rc": -15, "error": "ssh to w1 exited -15"})
    # the agent killed that ssh itself (a stall, the deadline): its rc is ours, not the host's
    assert ship_explain("w1", {"rc": -9, "killed": True, "error": "w1 took no bytes"}) == "w1 took no bytes"


def test_ship_relay_reports_a_signal_as_a_shell_does():
    from orchestrator.hostside.ship_relay import shell_status
    assert [shell_status(rc) for rc in (0, 1, -9, -15)] == [0, 1, 137, 143]
    assert "SIGKILL (rc 137)" in describe_exit(shell_status(-9))


def test_modelsync_host_script_killed(monkeypatch):
    from orchestrator.executors.ssh import Result
    from orchestrator.modelsync import remote
    from orchestrator.modelsync.jobs import HostsideOp
    from orchestrator.outcomes import HostFailure

    class Session:
        class target:
            host = "s2"

        def run(self, argv, timeout, stdin):
            return Result(137, "", "progress 1\n")

    with pytest.raises(HostFailure) as e:
        remote.hostside(Session(), HostsideOp("verify", ()))
    assert "sync-model's host script (verify) was killed by SIGKILL (rc 137)" in str(e.value)
    assert e.value.rc == 137


def test_ssh_check_names_the_signal():
    from orchestrator.executors.ssh import Result, SSHError, SSHSession, SSHTarget
    s = object.__new__(SSHSession)          # no connection: only check()'s wording is under test
    s.target = SSHTarget("s1", "192.0.2.1")
    for rc, needle in ((137, "`df -k /n` was killed by SIGKILL (rc 137)"), (-1, "killed by a signal or lost its "
                       "connection (SSH gave no exit status, rc -1)"), (3, "`df -k /n` exited 3")):
        s.run = lambda argv, timeout, stdin, rc=rc: Result(rc, "", "")
        with pytest.raises(SSHError) as e:
            s.check(["df", "-k", "/n"])
        assert needle in str(e.value), str(e.value)
