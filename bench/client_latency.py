"""deployctl bench's client against vLLM's own benchmark client, on a server whose timing is known.

    python3 bench/client_latency.py [--levels 1,2,4] [--rounds 8] [--prefill-ms 60] [--token-ms 50]
                                    [--tokens 32] [--repeats 3]

bench/real_vllm.py compares `deployctl bench` with `vllm bench serve` on the real engine, where the
engine's own time moves from one request to the next (2 shared cores). This one takes the engine out:
a local SSE server (standard library, its own process) answers every chat request with vLLM's chunk
sequence (role chunk, one chunk per token, the usage chunk, [DONE]) after exactly --prefill-ms, then
one token every --token-ms. Both clients run against it, each in its own process, level by level, in
alternating order:

  deployctl  orchestrator/benchmark/loadgen.py `run_level` (httpx), in this interpreter;
  vLLM       `async_request_openai_chat_completions` of vLLM's benchmark library
             (vllm/benchmarks/lib/endpoint_request_func.py: aiohttp), in the conformance venv
             (tests/conformance), C workers back to back like ours.

What each client measures beyond the server's known timing is its own cost: TTFT - prefill and
ITL - token gap, in ms, and the ratio of the two clients' mean TTFT and ITL (goal: within 10 %).

`--url URL --model NAME` runs both clients against a real server instead (bench/real_vllm.py --keep
leaves one), with the same prompts (deployctl's): what is left between them is the clients'.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER = r'''
import asyncio, json, sys, time
prefill, gap, tokens = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3])

def chunk(delta=None, usage=None):
    doc = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                  "finish_reason": None}]}
    if usage is not None:
        doc["usage"] = usage
    data = ("data: " + json.dumps(doc) + "\n\n").encode()
    return b"%x\r\n%s\r\n" % (len(data), data)

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n")
                           if l.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            t0 = time.perf_counter()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n" + chunk({"role": "assistant", "content": ""}))
            await writer.drain()
            for i in range(tokens):     # token i leaves at prefill + i * gap after the request arrived
                await asyncio.sleep(max(0.0, t0 + prefill + i * gap - time.perf_counter()))
                writer.write(chunk({"content": " w"}))
                await writer.drain()
            writer.write(chunk(usage={"prompt_tokens": 80, "completion_tokens": tokens, "total_tokens": 80 + tokens}))
            data = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def main():
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(srv.sockets[0].getsockname()[1], flush=True)
    await srv.serve_forever()

asyncio.run(main())
'''

VLLM_CLIENT = r'''
import asyncio, json, sys, time
import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_chat_completions
url, model, c, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.stdin.read())     # the same prompts deployctl's client sends

async def main():
    conn = aiohttp.TCPConnector(limit=c, ttl_dns_cache=300, use_dns_cache=True, keepalive_timeout=60,
                                enable_cleanup_closed=True, force_close=False)
    async with aiohttp.ClientSession(connector=conn, trust_env=True,
                                     timeout=aiohttp.ClientTimeout(total=6 * 60 * 60)) as session:
        async def worker(w):
            out = []
            for r in range(rounds):
                inp = RequestFuncInput(prompt=prompts[w * rounds + r], api_url=url + "/v1/chat/completions",
                                       prompt_len=80, output_len=32, model=model, ignore_eos=True,
                                       extra_body={"temperature": 0})
                res = await async_request_openai_chat_completions(inp, session)
                assert res.success, res.error
                out.append({"ttft": res.ttft, "itl": (res.latency - res.ttft) / max(1, len(res.itl))})
            return out
        runs = await asyncio.gather(*(worker(w) for w in range(c)))
    print(json.dumps([x for w in runs for x in w]))

asyncio.run(main())
'''


def vllm_python() -> str:
    from tests.conformance.engines import venv_python     # the conformance tier's venv (cached)
    return str(venv_python("vllm"))


WORDS = 26     # about 80 tokens of the tiny Llama's tokenizer, chat template included


def ours(url: str, model: str, c: int, rounds: int, salt: int) -> list[dict]:
    from orchestrator.benchmark.loadgen import LoadSpec, run_level
    spec = LoadSpec(url=url, model=model, input_tokens=80, max_tokens=32, rounds=rounds, prompt_words=WORDS)
    run = asyncio.run(run_level(spec, c, rounds, salt))
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    return [{"ttft": r.ttft_s, "itl": r.itl_s} for r in run.results]


def theirs(py: str, url: str, model: str, c: int, rounds: int, salt: int) -> list[dict]:
    from orchestrator.benchmark.loadgen import synthetic_prompt
    prompts = [synthetic_prompt(WORDS, salt + i) for i in range(c * rounds)]
    p = subprocess.run([py, "-c", VLLM_CLIENT, url, model, str(c), str(rounds)], input=json.dumps(prompts),
                       capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise SystemExit(f"vLLM's client failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prefill-ms", type=float, default=60.0)
    ap.add_argument("--token-ms", type=float, default=50.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--url", help="a real server instead (e.g. bench/real_vllm.py --keep's deployment): "
                                  "both clients send the same prompts; TTFT cost is then not known")
    ap.add_argument("--model", default="m", help="served model name (with --url)")
    a = ap.parse_args()
    py = vllm_python()
    srv = None if a.url else subprocess.Popen(
        [sys.executable, "-c", SERVER, str(a.prefill_ms), str(a.token_ms), str(a.tokens)],
        stdout=subprocess.PIPE, text=True)
    salt = random.randrange(1 << 24)
    try:
        url = a.url.rstrip("/") if a.url else f"http://127.0.0.1:{srv.stdout.readline().strip()}"
        print((f"server: {url}" if a.url else f"server: TTFT {a.prefill_ms:g} ms, ITL {a.token_ms:g} ms, "
               f"{a.tokens} tokens") + f"; {a.rounds} requests per worker, {a.repeats} repeats, alternating order\n")
        print("| C | TTFT ms deployctl / vLLM (ratio) | client's TTFT cost ms deployctl / vLLM "
              "| ITL ms deployctl / vLLM (ratio) |")
        print("|---|---|---|---|")
        for c in (int(x) for x in a.levels.split(",")):
            got: dict[str, list[dict]] = {"ours": [], "theirs": []}
            for i in range(a.repeats):
                order = ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")
                for who in order:
                    salt += c * a.rounds       # every request a new prompt (no prefix-cache hits)
                    got[who] += (ours(url, a.model, c, a.rounds, salt) if who == "ours" else
                                 theirs(py, url, a.model, c, a.rounds, salt))
            m = {k: {f: statistics.mean(x[f] for x in v) * 1e3 for f in ("ttft", "itl")} for k, v in got.items()}
            o, t = m["ours"], m["theirs"]
            cost = "-" if a.url else f"{o['ttft'] - a.prefill_ms:.2f} / {t['ttft'] - a.prefill_ms:.2f}"
            print(f"| {c} | {o['ttft']:.2f} / {t['ttft']:.2f} ({o['ttft'] / t['ttft']:.3f}) | {cost} "
                  f"| {o['itl']:.2f} / {t['itl']:.2f} ({o['itl'] / t['itl']:.3f}) |")
    finally:
        if srv:
            srv.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
