"""Streaming load generator for OpenAI-compatible chat APIs (vLLM, SGLang).

Definitions (the same as the measured results in docs/deployment-facts.md):

* A level at concurrency C runs C workers at once; each worker sends `rounds` requests back to back
  (closed loop), so a level makes C x rounds requests with C in flight at all times.
* TTFT: request sent -> first chunk carrying generated text (queueing and prefill included).
* ITL: (last token time - first token time) / (output tokens - 1), the mean gap per token after the
  first (per token, not per chunk: speculative decoding sends several tokens per chunk).
* TPS: output tokens / whole request time (TTFT included), per request.
* Latency: request sent -> end of the stream.
* Output tokens: `usage.completion_tokens` of the final usage chunk, else the number of text chunks.

All timing uses the monotonic clock (time.perf_counter). Every request has a deadline: network errors,
HTTP errors, error events inside the stream and streams that end early are failures, never hangs.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

# Short common words that are one token in the usual BPE vocabularies.
_WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "was", "with", "as", "at",
          "by", "this", "from", "or", "an", "be", "are", "not", "but", "all", "one", "can", "had",
          "her", "his", "we", "they", "there", "out", "so", "up", "if", "about", "who", "get", "which")
_TEXT_KEYS = ("content", "reasoning_content", "reasoning")


@dataclass(frozen=True)
class LoadSpec:
    """What to send. `model` is the served model name."""
    url: str                       # API base, e.g. http://10.0.0.1:8000
    model: str
    input_tokens: int = 128
    max_tokens: int = 128
    rounds: int = 10
    timeout_s: float = 300.0       # per request, whole stream
    connect_timeout_s: float = 10.0
    api_key: str | None = field(default=None, repr=False)   # sent as a Bearer token; never in a report


@dataclass
class RequestResult:
    ok: bool
    start: float                   # perf_counter at send
    end: float                     # perf_counter at end of stream or failure
    ttft_s: float | None = None
    last_token_s: float | None = None  # since start
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.end - self.start

    @property
    def tps(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def itl_s(self) -> float | None:
        if self.ttft_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LevelRun:
    concurrency: int
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)


def synthetic_prompt(n_words: int, salt: int) -> str:
    """About n_words one-token words; `salt` makes each request's prefix unique (no prefix-cache hits)."""
    words = [f"R{salt}:"] + [_WORDS[(salt * 7 + i * 13) % len(_WORDS)] for i in range(max(0, n_words - 1))]
    return " ".join(words)


def request_body(spec: LoadSpec, salt: int) -> dict:
    return {
        "model": spec.model,
        "messages": [{"role": "user", "content": synthetic_prompt(spec.input_tokens, salt)}],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,        # vLLM and SGLang: generate max_tokens; other servers ignore it
    }


def _delta_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return "".join(v for k in _TEXT_KEYS if isinstance(v := delta.get(k), str))


def _error_message(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}} or {"message": ...})."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if isinstance(doc, dict):
        err = doc.get("error")
        for cand in (err.get("message") if isinstance(err, dict) else err, doc.get("message")):
            if isinstance(cand, str) and cand:
                return cand
    return body


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def one_request(client: httpx.AsyncClient, spec: LoadSpec, salt: int) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start, end=start)
    try:
        await asyncio.wait_for(_stream(client, spec, salt, res), timeout=spec.timeout_s)
    except asyncio.TimeoutError:
        res.error = f"timed out after {spec.timeout_s:g} s"
    except httpx.TimeoutException as e:
        res.error = f"timed out ({type(e).__name__})"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {_short(str(e)) or 'connection failed'}"
    res.end = time.perf_counter()
    if res.ok and res.ttft_s is None:
        res.ok, res.error = False, "stream finished without any generated text"
    return res


async def _stream(client: httpx.AsyncClient, spec: LoadSpec, salt: int, res: RequestResult) -> None:
    usage_tokens = None
    async with client.stream("POST", f"{spec.url.rstrip('/')}/v1/chat/completions",
                             json=request_body(spec, salt)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            res.error = f"HTTP {resp.status_code}: {_short(_error_message(body))}"
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter() - res.start
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                res.ok = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                res.error = f"bad stream event: {_short(data)}"
                return
            if "error" in event:
                res.error = "error in stream: " + _short(_error_message(data))
                return
            usage = event.get("usage")
            if isinstance(usage, dict):
                usage_tokens = usage.get("completion_tokens", usage_tokens)
                res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
            for choice in event.get("choices") or ():
                if _delta_text(choice):
                    res.chunks += 1
                    if res.ttft_s is None:
                        res.ttft_s = now
                    res.last_token_s = now
        else:
            res.error = "stream ended without [DONE]"
            return
    res.output_tokens = usage_tokens if isinstance(usage_tokens, int) and usage_tokens > 0 else res.chunks


def _client(spec: LoadSpec, concurrency: int) -> httpx.AsyncClient:
    timeout = httpx.Timeout(spec.timeout_s, connect=min(spec.connect_timeout_s, spec.timeout_s))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, headers=_auth(spec.api_key))


def _auth(api_key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


async def run_level(spec: LoadSpec, concurrency: int, rounds: int, salt0: int = 0) -> LevelRun:
    """C workers, each sending `rounds` requests back to back; wall time from first send to last end."""
    async with _client(spec, concurrency) as client:
        async def worker(w: int) -> list[RequestResult]:
            return [await one_request(client, spec, salt0 + w * rounds + r) for r in range(rounds)]

        t0 = time.perf_counter()
        per_worker = await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    return LevelRun(concurrency, wall, [r for rs in per_worker for r in rs])


async def list_models(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[str]:
    """Served model names from GET /v1/models (raises httpx.HTTPError when the API does not answer)."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=_auth(api_key)) as client:
        resp = await client.get(f"{url.rstrip('/')}/v1/models")
        resp.raise_for_status()
        return [m.get("id", "") for m in resp.json().get("data", []) if isinstance(m, dict)]


async def sweep(spec: LoadSpec, levels: tuple[int, ...], warmup: bool = True,
                progress: Callable[[str], None] | None = None) -> tuple[LevelRun | None, list[LevelRun]]:
    """Warm-up round (one request per worker of the first level, not measured), then each level in order."""
    say = progress or (lambda _msg: None)
    warm = None
    salt = int(time.time()) % 100000 * 1000
    if warmup and levels:
        say(f"warm-up: {levels[0]} request(s)")
        warm = await run_level(spec, levels[0], 1, salt)
        salt += levels[0]
    runs = []
    for c in levels:
        say(f"C={c}: {c} x {spec.rounds} request(s) ...")
        run = await run_level(spec, c, spec.rounds, salt)
        salt += c * spec.rounds
        failed = sum(not r.ok for r in run.results)
        say(f"C={c}: done in {run.wall_s:.1f} s" + (f", {failed} failed" if failed else ""))
        runs.append(run)
    return warm, runs
