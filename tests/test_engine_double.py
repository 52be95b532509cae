"""Tests for the engine double (tests/engine_double/engine_double.py), the vLLM/SGLang stand-in.

Everything runs as local processes on 127.0.0.1 (free ports), except the one `docker` test, which builds
the image from tests/engine_double/Dockerfile and runs it with --network host (still loopback only).
Every wait is a bounded loop; every process started here is killed by its own handle at teardown.
"""
from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DOUBLE_DIR = HERE / "engine_double"
DOUBLE = DOUBLE_DIR / "engine_double.py"
SHIMS = DOUBLE_DIR / "shims"
LOOP = "127.0.0.1"

# Tolerances for the timing checks (the double sleeps until monotonic deadlines, so the error is the
# scheduling noise of this machine plus HTTP overhead, not accumulated drift).
TTFT_TOL_S = 0.060          # TTFT 200 ms +- 60 ms
RATE_TOL = 0.15             # 50 tok/s +- 15 %


# ------------------------------------------------------------------------------------------ helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOUBLE_", "DSV41_"))}
    env.update({"DOUBLE_LOAD_S": "0.2", "DOUBLE_TTFT_MS": "20", "DOUBLE_TOKENS_PER_S": "500",
                "DOUBLE_JOIN_TIMEOUT_S": "20", "PYTHONUNBUFFERED": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Proc:
    def __init__(self, popen: subprocess.Popen, log_path: Path):
        self.popen, self.log_path = popen, log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {self.pid} still running after {timeout} s; log:\n{self.log()}") from None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log():
                return
            if not self.alive() and needle not in self.log():
                break
            time.sleep(0.05)
        assert needle in self.log(), f"{needle!r} not in log of pid {self.pid}:\n{self.log()}"


@pytest.fixture
def spawn(tmp_path):
    procs: list[Proc] = []

    def _spawn(args: list[str], env: dict | None = None, cmd: list[str] | None = None) -> Proc:
        log_path = tmp_path / f"proc-{len(procs)}.log"
        fh = open(log_path, "wb")
        argv = (cmd or [sys.executable, str(DOUBLE)]) + args
        popen = subprocess.Popen(argv, env=env or base_env(), stdout=fh, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        fh.close()
        proc = Proc(popen, log_path)
        procs.append(proc)
        return proc

    yield _spawn
    for p in procs:
        if p.alive():
            p.popen.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=5)


def request(port: int, method: str, path: str, body=None, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(LOOP, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def health(port: int) -> int | None:
    """Status of GET /health, or None when nothing answers (not bound yet)."""
    try:
        return request(port, "GET", "/health", timeout=2.0)[0]
    except (ConnectionError, socket.timeout, OSError):
        return None


def wait_health(port: int, want: int, timeout: float, proc: Proc | None = None) -> float:
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        status = health(port)
        if status == want:
            return time.monotonic()
        if proc is not None and not proc.alive():
            break
        time.sleep(0.05)
    log = proc.log() if proc is not None else ""
    raise AssertionError(f"/health on {port} is {status}, wanted {want} within {timeout} s\n{log}")


def stream_chat(port: int, body: dict, path: str = "/v1/chat/completions", timeout: float = 20.0) -> dict:
    """POST a streaming request; return the text, per-content-chunk arrival times and the parsed chunks."""
    conn = http.client.HTTPConnection(LOOP, port, timeout=timeout)
    try:
        t0 = time.monotonic()
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        times, pieces, chunks, done = [], [], [], False
        for _ in range(100000):
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: "):]
            if payload == b"[DONE]":
                done = True
                continue
            obj = json.loads(payload)
            chunks.append(obj)
            for ch in obj.get("choices", []):
                piece = ch.get("delta", {}).get("content") if "delta" in ch else ch.get("text")
                if piece:
                    times.append(time.monotonic() - t0)
                    pieces.append(piece)
        return {"text": "".join(pieces), "pieces": pieces, "times": times, "chunks": chunks, "done": done}
    finally:
        conn.close()


def vllm_args(port: int, name: str = "dsv", *extra: str) -> list[str]:
    return ["vllm", "serve", "/models/DeepSeek-V4.1-Flash", "--port", str(port), "--host", LOOP,
            "--served-model-name", name, *extra]


def multinode_args(rank: int, nnodes: int, api: int, master: int) -> list[str]:
    args = ["vllm", "serve", "/models/DeepSeek-V4.1-Flash", "--tensor-parallel-size", str(nnodes),
            "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", LOOP,
            "--master-port", str(master), "--distributed-executor-backend", "mp",
            "--port", str(api), "--host", LOOP, "--served-model-name", "deepseek-v4.1-flash",
            "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 5}',
            "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v41"]
    if rank > 0:
        args.append("--headless")
    return args


COUNT = {"messages": [{"role": "user", "content": "Count from 1 to 10."}], "max_tokens": 50}


# --------------------------------------------------------------------------------------- multi-node

def test_vllm_head_and_three_workers(spawn, tmp_path):
    api, master = free_port(), free_port()
    rec = tmp_path / "rec"
    env = base_env(DOUBLE_LOAD_S="0.5", DOUBLE_RECORD_DIR=rec, DOUBLE_PEER_TIMEOUT_S="5")
    head = spawn(multinode_args(0, 4, api, master), env)
    # worker 1 through the `vllm` shim, as in the image
    w1 = spawn(multinode_args(1, 4, api, master)[1:], env, cmd=[sys.executable, str(SHIMS / "vllm")])
    w2 = spawn(multinode_args(2, 4, api, master), env)
    head.wait_log("worker rank 1 joined", 10)
    head.wait_log("worker rank 2 joined", 10)
    time.sleep(1.0)  # twice the load time: a head that did not wait for rank 3 would be up by now
    assert health(api) is None, "API port bound before all workers joined"
    assert head.alive() and w1.alive() and w2.alive()

    t_last = time.monotonic()
    w3 = spawn(multinode_args(3, 4, api, master), env)
    t_ready = wait_health(api, 200, 15, head)
    assert t_ready - t_last >= 0.5, "ready before the simulated load time elapsed"
    log = head.log()
    assert "rendezvous complete: all 4 nodes joined" in log
    assert "Loading weights: 40%" in log and "Application startup complete." in log

    status, body = request(api, "GET", "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == ["deepseek-v4.1-flash"]
    out = stream_chat(api, {**COUNT, "model": "deepseek-v4.1-flash"})
    assert out["text"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10" and out["done"]
    for r in range(4):
        rec_r = json.loads((rec / f"argv-vllm-rank{r}.json").read_text())
        assert rec_r["node_rank"] == r and rec_r["engine"] == "vllm"
        assert ("--headless" in rec_r["argv"]) == (r > 0)

    # a second worker claiming rank 1 is rejected while rank 1 is connected
    dup = spawn(multinode_args(1, 4, api, master), base_env(DOUBLE_JOIN_TIMEOUT_S="5"))
    assert dup.wait(8) != 0
    assert "rejected node rank 1" in dup.log() and "duplicate node rank 1" in dup.log()
    assert health(api) == 200

    # a worker node not beside rank 0 in gloo's ring dying after ready (rank 2 of 4): like the released
    # vLLM at TP=4, /health stays 200 and the next request waits forever (a wedge)
    w2.popen.send_signal(signal.SIGKILL)
    head.wait_log("lost worker rank 2", 3)
    assert health(api) == 200
    with pytest.raises(OSError):                    # socket.timeout: nothing ever answers
        request(api, "POST", "/v1/chat/completions", COUNT, timeout=2.0)
    assert head.alive() and health(api) == 200
    # relaunching only the lost worker joins a finished rendezvous and hangs (the real engine's trap)
    late = spawn(multinode_args(2, 4, api, master), base_env(DOUBLE_JOIN_TIMEOUT_S="1.5"))
    assert late.wait(6) == 1
    assert "rendezvous never completed" in late.log()
    head.wait_log("arrived after the rendezvous completed", 2)
    # a worker beside rank 0 (rank 1): its next collective fails at once, 500 EngineDeadError, exit 0
    w1.popen.send_signal(signal.SIGKILL)
    head.wait_log("lost worker rank 1", 3)
    status, body = request(api, "GET", "/health")
    assert status == 200
    # workers whose head goes away exit non-zero
    head.popen.send_signal(signal.SIGKILL)
    for w in (w3,):
        assert w.wait(5) != 0
        assert "lost connection to the head" in w.log()


def test_worker_gives_up_when_head_unreachable(spawn):
    master = free_port()  # nothing listens there
    t0 = time.monotonic()
    w = spawn(multinode_args(1, 2, free_port(), master), base_env(DOUBLE_JOIN_TIMEOUT_S="1"))
    assert w.wait(6) == 1
    assert time.monotonic() - t0 >= 1.0
    assert f"could not join the head at {LOOP}:{master}" in w.log()


def test_worker_never_ready_blocks_head_then_dies_with_it(spawn):
    api, master = free_port(), free_port()
    head = spawn(multinode_args(0, 2, api, master), base_env())
    w1 = spawn(multinode_args(1, 2, api, master), base_env(DOUBLE_FAIL="never-ready", DOUBLE_FAIL_RANK="1"))
    head.wait_log("rendezvous complete", 10)
    w1.wait_log("never-ready", 5)
    time.sleep(0.6)
    assert health(api) is None and head.alive()
    # a worker lost during startup aborts the head
    w1.popen.send_signal(signal.SIGKILL)
    assert head.wait(5) == 1
    assert "worker rank 1 disconnected during startup" in head.log()


def test_worker_crash_later_fails_the_next_request_then_the_head(spawn):
    api, master = free_port(), free_port()
    env_w = base_env(DOUBLE_FAIL="crash-later", DOUBLE_CRASH_AFTER_S="0.5")
    head = spawn(multinode_args(0, 2, api, master), base_env(DOUBLE_FAIL="crash-later", DOUBLE_FAIL_RANK="1",
                                                              DOUBLE_CRASH_AFTER_S="0.5"))
    w1 = spawn(multinode_args(1, 2, api, master), env_w)
    wait_health(api, 200, 10, head)
    assert w1.wait(5) == 4
    head.wait_log("lost worker rank 1", 3)
    assert health(api) == 200 and head.alive(), "noticed at the next request, as the real engine"
    status, _ = request(api, "POST", "/v1/chat/completions", COUNT)
    assert status == 500 and head.wait(5) == 0


def test_silent_peer_counts_as_dead(spawn):
    api, master = free_port(), free_port()
    env = base_env(DOUBLE_PEER_TIMEOUT_S="1")
    head = spawn(multinode_args(0, 2, api, master), env)
    w1 = spawn(multinode_args(1, 2, api, master), env)
    wait_health(api, 200, 10, head)
    w1.popen.send_signal(signal.SIGSTOP)  # frozen host: no FIN, just silence
    try:
        head.wait_log("sent nothing for 1 s", 5)
        status, _ = request(api, "POST", "/v1/chat/completions", COUNT)
        assert status == 500 and head.wait(5) == 0
    finally:
        w1.popen.send_signal(signal.SIGKILL)


# ------------------------------------------------------------------------------------------ serving

def test_streaming_timing_and_api(spawn):
    port = free_port()
    p = spawn(vllm_args(port), base_env(DOUBLE_TTFT_MS="200", DOUBLE_TOKENS_PER_S="50"))
    wait_health(port, 200, 10, p)

    out = stream_chat(port, {"model": "dsv", "max_tokens": 40, "stream_options": {"include_usage": True},
                             "messages": [{"role": "system", "content": "You are terse."},
                                          {"role": "user", "content": "Tell me about the weather today please"}]})
    ttft = out["times"][0]
    assert abs(ttft - 0.200) <= TTFT_TOL_S, f"TTFT {ttft * 1000:.0f} ms, wanted 200 +- 60 ms"
    assert len(out["pieces"]) == 40
    rate = (len(out["times"]) - 1) / (out["times"][-1] - out["times"][0])
    assert abs(rate - 50) <= 50 * RATE_TOL, f"{rate:.1f} tok/s, wanted 50 +- 15 %"
    assert all(len(piece.split()) == 1 for piece in out["pieces"])   # one word per token
    assert len(out["text"].split()) == 40
    usage = [c for c in out["chunks"] if c.get("usage")]
    assert usage and usage[-1]["choices"] == []
    assert usage[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 40, "total_tokens": 50}
    finish = [ch["finish_reason"] for c in out["chunks"] for ch in c["choices"] if ch.get("finish_reason")]
    assert finish == ["length"]
    assert out["chunks"][0]["object"] == "chat.completion.chunk" and out["done"]

    # non-streaming: the reports' verification request
    t0 = time.monotonic()
    status, body = request(port, "POST", "/v1/chat/completions", {**COUNT, "model": "dsv"})
    elapsed = time.monotonic() - t0
    assert status == 200
    resp = json.loads(body)
    assert resp["choices"][0]["message"]["content"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    assert abs(elapsed - (0.2 + 9 / 50)) <= TTFT_TOL_S

    # max_tokens is honoured; completions endpoint streams too
    status, body = request(port, "POST", "/v1/completions", {"prompt": "Count from 1 to 10.", "max_tokens": 3})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "1, 2, 3,"
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"
    out = stream_chat(port, {"prompt": "a b c", "max_tokens": 5}, path="/v1/completions")
    assert len(out["pieces"]) == 5 and out["chunks"][0]["object"] == "text_completion"

    # errors like the real server
    assert request(port, "POST", "/v1/chat/completions", {**COUNT, "model": "nope"})[0] == 404
    assert request(port, "POST", "/v1/chat/completions", {"messages": []})[0] == 400
    assert request(port, "POST", "/v1/chat/completions", {**COUNT, "max_tokens": 0})[0] == 400

    status, body = request(port, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="dsv"}' in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",model_name="dsv",le="+Inf"}' in text
    assert "vllm:generation_tokens_total" in text and "vllm:num_requests_running" in text


def test_concurrent_requests_and_queueing(spawn):
    free, queued = free_port(), free_port()
    env = dict(DOUBLE_TTFT_MS="100", DOUBLE_TOKENS_PER_S="100")
    p1 = spawn(vllm_args(free), base_env(**env))
    p2 = spawn(vllm_args(queued), base_env(**env, DOUBLE_MAX_CONCURRENCY="1"))
    wait_health(free, 200, 10, p1)
    wait_health(queued, 200, 10, p2)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 11}  # 0.1 + 10 * 0.01 = 0.2 s

    def run(port: int, n: int) -> list[float]:
        results: list = [None] * n

        def one(i: int) -> None:
            results[i] = stream_chat(port, body)["times"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert all(r is not None and len(r) == 11 for r in results)
        return sorted(r[0] for r in results)

    ttfts = run(free, 4)  # served concurrently: every request sees ~100 ms
    assert all(abs(t - 0.1) <= TTFT_TOL_S for t in ttfts), ttfts
    ttfts = run(queued, 2)  # DOUBLE_MAX_CONCURRENCY=1: the second waits for the first (~0.2 s)
    assert abs(ttfts[0] - 0.1) <= TTFT_TOL_S and abs(ttfts[1] - 0.3) <= TTFT_TOL_S, ttfts


# ------------------------------------------------------------------------------------ failure modes

def test_crash_at_start(spawn):
    p = spawn(vllm_args(free_port()), base_env(DOUBLE_FAIL="crash-at-start"))
    assert p.wait(5) == 3
    assert "crash-at-start" in p.log()


def test_fail_rank_limits_the_failure(spawn):
    port = free_port()
    p = spawn(vllm_args(port), base_env(DOUBLE_FAIL="crash-at-start", DOUBLE_FAIL_RANK="1"))
    wait_health(port, 200, 10, p)


def test_never_ready(spawn):
    port = free_port()
    p = spawn(vllm_args(port), base_env(DOUBLE_FAIL="never-ready"))
    p.wait_log("never-ready", 5)
    time.sleep(0.5)
    assert health(port) is None and p.alive()


def test_crash_later(spawn):
    port = free_port()
    p = spawn(vllm_args(port), base_env(DOUBLE_FAIL="crash-later", DOUBLE_CRASH_AFTER_S="1"))
    t_ready = wait_health(port, 200, 10, p)
    assert p.wait(5) == 4
    assert time.monotonic() - t_ready >= 0.8
    assert health(port) is None


def test_slow(spawn):
    port = free_port()
    p = spawn(vllm_args(port), base_env(DOUBLE_FAIL="slow", DOUBLE_TTFT_MS="15"))
    wait_health(port, 200, 10, p)
    out = stream_chat(port, {**COUNT, "max_tokens": 2})
    assert abs(out["times"][0] - 0.300) <= TTFT_TOL_S, out["times"]  # 15 ms x 20


def test_error_mid(spawn):
    port = free_port()
    p = spawn(vllm_args(port), base_env(DOUBLE_FAIL="error-mid", DOUBLE_ERROR_AFTER="2"))
    wait_health(port, 200, 10, p)
    codes = [request(port, "POST", "/v1/chat/completions", COUNT)[0] for _ in range(4)]
    assert codes == [200, 200, 500, 500]
    assert health(port) == 200


# ----------------------------------------------------------------------------- arguments and records

def test_argv_and_env_recorded_with_secrets_masked(spawn, tmp_path):
    port = free_port()
    rec = tmp_path / "rec"
    env = base_env(DOUBLE_RECORD_DIR=rec, HF_TOKEN="hf_secret", MY_API_KEY="k1", DB_PASSWORD="pw",
                   CLIENT_SECRET="s", OMP_NUM_THREADS="1", NCCL_SOCKET_IFNAME="enp1s0f0np0")
    args = vllm_args(port, "dsv", "--api-key", "sk-123", "--limit-mm-per-prompt", '{"image":4}',
                     "--default-chat-template-kwargs", '{"thinking": false}', "--enforce-eager",
                     "--some-future-flag", "x", "--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}')
    p = spawn(args, env)
    wait_health(port, 200, 10, p)
    record = json.loads((rec / "argv-vllm-rank0.json").read_text())
    assert record["engine"] == "vllm" and record["node_rank"] == 0
    assert isinstance(record["started"], float) and abs(record["started"] - time.time()) < 60
    assert record["argv"][:3] == ["vllm", "serve", "/models/DeepSeek-V4.1-Flash"]
    assert record["argv"][record["argv"].index("--api-key") + 1] == "***"
    assert "sk-123" not in json.dumps(record)
    assert "--some-future-flag" in record["argv"] and record["flags"]["some-future-flag"] == "x"
    assert record["flags"]["enforce-eager"] is True
    e = record["env"]
    assert e["HF_TOKEN"] == e["MY_API_KEY"] == e["DB_PASSWORD"] == e["CLIENT_SECRET"] == "***"
    assert e["OMP_NUM_THREADS"] == "1" and e["NCCL_SOCKET_IFNAME"] == "enp1s0f0np0"
    first = p.log().splitlines()[0]
    assert "engine=vllm" in first and "served=dsv" in first


@pytest.mark.parametrize("flag", ["--speculative-config", "--compilation-config",
                                  "--default-chat-template-kwargs", "--limit-mm-per-prompt"])
def test_invalid_json_flag_exits_2(spawn, flag):
    p = spawn(vllm_args(free_port(), "dsv", flag, "{'image': 4"))
    assert p.wait(5) == 2
    assert f"argument {flag}" in p.log()


def test_bad_int_flag_exits_2(spawn):
    p = spawn(vllm_args(free_port(), "dsv", "--tensor-parallel-size", "four"))
    assert p.wait(5) == 2 and "invalid int value" in p.log()


# ------------------------------------------------------------------------------------- staged data

def sglang_cmd() -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server"]


def sglang_env(**extra) -> dict:
    return base_env(PYTHONPATH=str(SHIMS), **extra)


def sglang_args(port: int, ple_dir: Path, backend: str = "file",
                model: str = "/models/Qwen3.8-Flash-Next-NVFP4", embedding: bool = True) -> list[str]:
    return ["--model-path", model, "--tp-size", "1", "--port", str(port),
            "--host", LOOP, "--served-model-name", "qwen3.8-flash-next", "--speculative-algorithm", "NEXTN",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            *(["--ple-offload-embedding"] if embedding else []),
            "--ple-offload-backend", backend, "--ple-offload-dir", str(ple_dir),
            "--mem-fraction-static", "0.8", "--max-running-requests", "8", "--context-length", "262144"]


PATCHES = HERE.parent / "dockerfiles" / "sglang-qwen38" / "patches"


@pytest.fixture
def qwen_ckpt(tmp_path):
    from tests import synth
    return synth.qwen_checkpoint_and_table(tmp_path)


def ple_env(**extra) -> dict:
    return base_env(PYTHONPATH=f"{SHIMS}:{PATCHES}", SGLANG_EXTERNAL_MODEL_PACKAGE="deployctl_sglang_ple", **extra)


def test_sglang_ple_table_as_the_released_engine_maps_it(spawn, tmp_path, qwen_ckpt):
    ck, table = qwen_ckpt
    want, st = table.read_bytes(), table.stat()
    # 1. the table deployctl wrote is kept by the patch: nothing written, same inode and mtime
    port = free_port()
    ok = spawn(sglang_args(port, table.parent, model=str(ck)),
               ple_env(DOUBLE_RECORD_DIR=tmp_path / "rec"), cmd=sglang_cmd())
    wait_health(port, 200, 10, ok)
    assert f"file-backed mmap {table}" in ok.log()
    assert "PLE table kept" in ok.log() and "0 bytes written" in ok.log(), ok.log()
    assert table.read_bytes() == want and (table.stat().st_ino, table.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    status, body = request(port, "GET", "/get_model_info")
    assert status == 200 and json.loads(body)["model_path"] == str(ck)
    out = stream_chat(port, {**COUNT, "model": "qwen3.8-flash-next"})
    assert out["text"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    record = json.loads((tmp_path / "rec" / "argv-sglang-rank0.json").read_text())
    assert record["engine"] == "sglang" and record["argv"][:3] == ["python3", "-m", "sglang.launch_server"]

    # 2. an empty folder: the engine's loader writes the table itself, to the very bytes deployctl writes
    fresh = tmp_path / "fresh"
    p2 = spawn(sglang_args(free_port(), fresh, model=str(ck)), ple_env(), cmd=sglang_cmd())
    p2.wait_log("PLE table written by the loader", 10)
    assert "does not exist" not in p2.log()          # the file exists once allocated: no manifest
    assert "no deployctl manifest" in p2.log()
    assert (fresh / table.name).read_bytes() == want
    # 3. upstream without the patch package rewrites even a valid table (the 55-minute restarts)
    p3 = spawn(sglang_args(free_port(), table.parent, model=str(ck)), sglang_env(), cmd=sglang_cmd())
    p3.wait_log("PLE table written by the loader: no patch package", 10)
    assert table.read_bytes() == want and table.stat().st_mtime_ns != st.st_mtime_ns


def test_sglang_ple_contract_failures(spawn, tmp_path, qwen_ckpt):
    ck, table = qwen_ckpt
    # --ple-offload-backend file without --ple-offload-embedding: upstream's ValueError
    p = spawn(sglang_args(free_port(), table.parent, model=str(ck), embedding=False), ple_env(), cmd=sglang_cmd())
    assert p.wait(5) == 6 and "requires --ple-offload-embedding" in p.log()
    # a table touched after deployctl wrote it is rewritten by the loader (never trusted)
    os.utime(table, ns=(table.stat().st_atime_ns, table.stat().st_mtime_ns + 10**9))
    p = spawn(sglang_args(free_port(), table.parent, model=str(ck)), ple_env(), cmd=sglang_cmd())
    p.wait_log("PLE table written by the loader: ", 10)
    assert "modified or replaced after deployctl wrote it" in p.log()
    # pinned: no file at all
    pinned_port = free_port()
    empty = tmp_path / "none"
    pinned = spawn(["sglang", *sglang_args(pinned_port, empty, "pinned", model=str(ck))], base_env())
    wait_health(pinned_port, 200, 10, pinned)
    assert not empty.exists()
    assert request(pinned_port, "GET", "/health_generate")[0] == 200


# ------------------------------------------------------------------------------------------- docker

IMAGE = "dctl-engine-double:test"
BASE_IMAGE = "dctl-debian:bookworm"


def _docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc


def _ensure_base_image() -> None:
    """Use the test cluster's ensure_base_images() when it exists, else debootstrap + import ourselves."""
    images_py = HERE / "cluster" / "images.py"
    if images_py.exists():
        spec = importlib.util.spec_from_file_location("_dctl_cluster_images", images_py)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if hasattr(mod, "ensure_base_images"):
            mod.ensure_base_images()
            return
    if _docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dctl-debian-") as tmp:
        root = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,ca-certificates", "bookworm",
                        str(root), "http://deb.debian.org/debian"], check=True, capture_output=True, timeout=1800)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True)
        tar.stdout.close()
        assert tar.wait() == 0


@pytest.mark.docker
def test_docker_image(tmp_path, qwen_ckpt):
    if not Path("/var/run/docker.sock").exists():
        pytest.fail("no local Docker engine on /var/run/docker.sock (start dockerd: .ci/setup does)")
    _ensure_base_image()
    from tests.double_image import build as build_double     # the double + the image's patch package
    build_double(IMAGE, BASE_IMAGE)
    ck, table = qwen_ckpt
    st = table.stat()
    tag = uuid.uuid4().hex[:8]
    vport, sport = free_port(), free_port()
    names = [f"dctl-double-test-vllm-{tag}", f"dctl-double-test-sglang-{tag}", f"dctl-double-test-ro-{tag}"]
    mounts = ["-v", f"{ck}:/model:ro", "-e", "SGLANG_EXTERNAL_MODEL_PACKAGE=deployctl_sglang_ple"]
    try:
        _docker("run", "-d", "--name", names[0], "--network", "host", "-e", "DOUBLE_LOAD_S=0.3",
                "-e", "DOUBLE_TTFT_MS=20", IMAGE, *vllm_args(vport, "deepseek-v4.1-flash",
                                                            "--distributed-executor-backend", "mp"), timeout=60)
        _docker("run", "-d", "--name", names[1], "--network", "host", "-e", "DOUBLE_LOAD_S=0.3",
                *mounts, "-v", f"{table.parent}:/ple:rw", IMAGE, "python3", "-m", "sglang.launch_server",
                *sglang_args(sport, Path("/ple"), model="/model"), timeout=60)
        # SGLang maps the table read-write (torch.from_file(shared=True)): a read-only mount fails
        _docker("run", "--name", names[2], "--network", "host", *mounts, "-v", f"{table.parent}:/ple:ro",
                IMAGE, "python3", "-m", "sglang.launch_server", *sglang_args(free_port(), Path("/ple"), model="/model"),
                timeout=60, check=False)
        ro = _docker("logs", names[2], check=False)
        assert "cannot map /ple/" in ro.stdout + ro.stderr and "Read-only file system" in ro.stdout + ro.stderr
        for port, name in ((vport, names[0]), (sport, names[1])):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and health(port) != 200:
                time.sleep(0.1)
            assert health(port) == 200, _docker("logs", name, check=False).stdout
        status, body = request(vport, "POST", "/v1/chat/completions", {**COUNT, "model": "deepseek-v4.1-flash"})
        assert status == 200
        assert json.loads(body)["choices"][0]["message"]["content"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
        out = stream_chat(sport, {**COUNT, "model": "qwen3.8-flash-next"})
        assert out["text"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
        logs = _docker("logs", names[0], check=False)
        assert "Loading weights: 40%" in logs.stdout and "Application startup complete." in logs.stdout
        assert "PLE table kept" in _docker("logs", names[1], check=False).stdout
        assert (table.stat().st_ino, table.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
        # docker stop: the double handles SIGTERM as PID 1 (no 10 s kill timeout)
        t0 = time.monotonic()
        _docker("stop", "-t", "10", names[0], timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        _docker("rm", "-f", *names, check=False, timeout=60)
