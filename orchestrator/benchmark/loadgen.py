"""Streaming load generator for OpenAI-compatible chat APIs (vLLM, SGLang).

Definitions (the same as the measured results in docs/deployment-facts.md):

* A level at concurrency C runs C workers at once; each worker sends `rounds` requests back to back
  (closed loop), so a level makes C x rounds requests with C in flight at all times.
* TTFT: request sent -> first chunk carrying a generated token (queueing and prefill included),
  by vLLM's rule for which chunks do (`_is_token`).
* ITL: (last token time - first token time) / (output tokens - 1), the mean gap per token after the
  first (per token, not per chunk: speculative decoding sends several tokens per chunk).
* TPS: output tokens / whole request time (TTFT included), per request.
* Latency: request sent -> end of the stream.
* Output tokens: `usage.completion_tokens` of the final usage chunk, else the number of text chunks.
* Input tokens: the prompt's filler is sized on the served model's own tokenizer before the sweep
  (`size_prompt`), so that `input_tokens` counts the model's tokens, not words, as vLLM's own
  `vllm bench serve` does (vllm/benchmarks/serve.py aligns its random prompts with the server's
  /tokenize; lib/endpoint_request_func.py counts usage.prompt_tokens). The chat template's own tokens
  come on top, in both.

All timing uses the monotonic clock (time.perf_counter). Every request has a deadline: network errors,
HTTP errors, error events inside the stream and streams that end early are failures, never hangs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
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
    prompt_words: int | None = None  # filler words per prompt (size_prompt); None: input_tokens words

    @property
    def words(self) -> int:
        return self.prompt_words or self.input_tokens


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


SALT_WORDS = 4   # the words that spell a request's salt: len(_WORDS) ** 4 = 2.56 M different starts


def synthetic_prompt(n_words: int, salt: int) -> str:
    """n_words words (at least one). The first SALT_WORDS spell `salt` in base len(_WORDS), so every
    request's prompt starts differently (no prefix-cache hits) and is made of the same words as the
    filler (size_prompt's cost per word holds for the whole prompt)."""
    k = len(_WORDS)
    head = [_WORDS[(salt // k ** i) % k] for i in range(SALT_WORDS)]
    filler = [_WORDS[(salt * 7 + i * 13) % k] for i in range(max(0, n_words - SALT_WORDS))]
    return " ".join((head + filler)[:max(1, n_words)])


def _salt_base() -> int:
    """A per-run start for the salts, so that reruns against one engine do not hit its prefix cache."""
    return random.randrange(len(_WORDS) ** SALT_WORDS)


def request_body(spec: LoadSpec, salt: int) -> dict:
    return {
        "model": spec.model,
        "messages": [{"role": "user", "content": synthetic_prompt(spec.words, salt)}],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,        # vLLM and SGLang: generate max_tokens; other servers ignore it
    }


def _is_token(choice: dict) -> bool:
    """Whether a stream chunk's choice carries generated output, by vLLM's own rule
    (vllm/benchmarks/lib/endpoint_request_func.py `_choice_has_streamed_output`): text, reasoning or a
    tool call; or an empty `content` without `role`, a token that decodes to nothing (a byte-level
    tokenizer's partial character, a skipped special token). The opening chunk has `role`."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if any(isinstance(v := delta.get(k), str) and v for k in _TEXT_KEYS):
        return True
    if delta.get("tool_calls") or delta.get("function_call"):
        return True
    return delta.get("content") == "" and "role" not in delta


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
        res.ok, res.error = False, "stream finished without any generated token"
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
            if res.ok or not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                # read on to the end of the body: a response left unread closes its connection, and
                # every request then opens a new one. vLLM's client keeps its connections (one
                # aiohttp session, TCPConnector keepalive_timeout=60, force_close=False:
                # vllm/benchmarks/serve.py `benchmark`, 0.33); with new
                # ones the C requests of a closed loop reach the engine spread out, and at C=4 one
                # that misses the engine's step waits a step more (TTFT +15-30 ms at TP=4 here)
                res.ok = True
                continue
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
                if _is_token(choice):
                    res.chunks += 1
                    if res.ttft_s is None:
                        res.ttft_s = now
                    res.last_token_s = now
        if not res.ok:
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


@dataclass(frozen=True)
class PromptSize:
    """How the prompt was sized: `words` filler words make about input_tokens tokens of the served
    model. `tokens_per_word` is None when the server reports no usage.prompt_tokens (then one word
    is taken as one token), and `why` says so."""
    words: int
    tokens_per_word: float | None
    probes: tuple[int, ...] = ()   # usage.prompt_tokens of the probes (SALT_WORDS, + input_tokens words)
    why: str = ""

    def to_json(self) -> dict:
        return {"words": self.words, "tokens_per_word": None if self.tokens_per_word is None else
                round(self.tokens_per_word, 3), "probe_prompt_tokens": list(self.probes), "note": self.why}


async def size_prompt(spec: LoadSpec, salt: int | None = None) -> PromptSize:
    """Two unmeasured probes (max_tokens 1), with one salt: a prompt of the salt words alone and one
    with input_tokens filler words more. The difference of their usage.prompt_tokens is what input_tokens
    words cost on this model's tokenizer (the chat template cancels out), so input_tokens tokens take
    input_tokens / slope words, salt included. Any engine that reports usage works (vLLM, SGLang,
    the double)."""
    n = spec.input_tokens
    salt = _salt_base() if salt is None else salt
    probe = dataclasses.replace(spec, max_tokens=1)
    async with _client(spec, 1) as client:
        small = await one_request(client, dataclasses.replace(probe, prompt_words=SALT_WORDS), salt)
        large = await one_request(client, dataclasses.replace(probe, prompt_words=SALT_WORDS + n), salt)
    got = [r.prompt_tokens for r in (small, large)]
    if not (small.ok and large.ok):
        why = next(r.error for r in (small, large) if not r.ok)
        return PromptSize(n, None, why=f"prompt not sized (a probe failed: {why}); one word per token")
    if not all(isinstance(t, int) for t in got) or got[1] <= got[0]:
        return PromptSize(n, None, tuple(t for t in got if isinstance(t, int)),
                          why="the server reports no usable usage.prompt_tokens; one word per token")
    slope = (got[1] - got[0]) / n
    return PromptSize(max(1, round(n / slope)), slope, tuple(got))


async def list_models(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[str]:
    """Served model names from GET /v1/models (raises httpx.HTTPError when the API does not answer)."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=_auth(api_key)) as client:
        resp = await client.get(f"{url.rstrip('/')}/v1/models")
        resp.raise_for_status()
        return [m.get("id", "") for m in resp.json().get("data", []) if isinstance(m, dict)]


async def sweep(spec: LoadSpec, levels: tuple[int, ...], warmup: bool = True,
                progress: Callable[[str], None] | None = None) -> tuple[LevelRun | None, list[LevelRun]]:
    """Warm-up round (one request per worker of the first level, not measured), then each level in
    order, with spec.prompt_words words per prompt (size it first with size_prompt)."""
    say = progress or (lambda _msg: None)
    warm = None
    salt = _salt_base()
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
