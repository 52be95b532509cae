"""One probe suite for an OpenAI-style engine API: what deployctl and its users rely on, reduced to
observations that must be equal between the released vLLM and the engine double wherever the double
imitates it (tests/test_real_vllm.py runs it against both and compares; a difference fails).

Each probe returns a JSON-able value: status codes, key sets, shapes, the order of stream events,
metric names; never the generated text, ids or times, which legitimately differ. Standard library only.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

# The metrics deployctl's docs and the dashboards name (vLLM's /metrics, Prometheus text).
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
           "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:time_to_first_token_seconds",
           "vllm:e2e_request_latency_seconds", "vllm:kv_cache_usage_perc")


class Client:
    def __init__(self, url: str, key: str | None, timeout: float = 60.0):
        u = urlsplit(url)
        self.host, self.port, self.key, self.timeout = u.hostname, u.port or 80, key, timeout

    def request(self, method: str, path: str, body: Any = None, key: bool = True,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            h = {"Content-Type": "application/json", **(headers or {})}
            if key and self.key:
                h["Authorization"] = f"Bearer {self.key}"
            c.request(method, path, json.dumps(body) if body is not None else None, h)
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def stream(self, path: str, body: dict) -> list[dict | str]:
        """The SSE events of a streamed completion: parsed JSON, or the literal [DONE]."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            h = {"Content-Type": "application/json"}
            if self.key:
                h["Authorization"] = f"Bearer {self.key}"
            c.request("POST", path, json.dumps(body), h)
            r = c.getresponse()
            events: list[dict | str] = []
            for raw in r.read().decode().split("\n\n"):
                raw = raw.strip()
                if raw.startswith("data: "):
                    data = raw[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
            return events
        finally:
            c.close()


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body.strip() else None
    except ValueError:
        return "(not JSON)"


def _error_shape(code: int, body: bytes) -> dict:
    doc = _json(body)
    err = doc.get("error") if isinstance(doc, dict) else None
    return {"status": code, "keys": sorted(doc) if isinstance(doc, dict) else doc,
            "error": (sorted(err) if isinstance(err, dict) else err)}


def stream_shape(events: list[dict | str], chat: bool) -> list[str]:
    """The order of event kinds: each chunk's parts joined with '+': role (the chat's first chunk),
    token (a chunk carrying generated text, be it empty: a token can decode to no text yet, half a
    UTF-8 character), finish:<reason>; a chunk of usage only "usage"; the end "DONE". Runs of token
    chunks are collapsed; `token_chunks` (probe_all) counts them."""
    kinds: list[str] = []
    for e in events:
        if e == "[DONE]":
            k = "DONE"
        elif not e.get("choices"):
            k = "usage" if e.get("usage") else "empty"
        else:
            ch = e["choices"][0]
            delta = ch.get("delta") or {}
            parts = []
            if chat and delta.get("role"):
                parts.append("role")
            elif ("content" in delta) if chat else ("text" in ch):
                parts.append("token")
            if ch.get("finish_reason"):
                parts.append(f"finish:{ch['finish_reason']}")
            k = "+".join(parts) or "empty"
        if not (k == "token" and kinds and kinds[-1] == "token"):
            kinds.append(k)
    return kinds


def token_chunks(events: list[dict | str], chat: bool) -> int:
    """Chunks that carry a generated token (the role chunk, usage and [DONE] excluded)."""
    n = 0
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            ch = e["choices"][0]
            delta = ch.get("delta") or {}
            if ("content" in delta and not delta.get("role")) if chat else ("text" in ch):
                n += 1
    return n


def probe_all(url: str, key: str | None, served: str) -> dict[str, Any]:
    """Every observation of a ready engine (see the module docstring)."""
    c = Client(url, key)
    obs: dict[str, Any] = {}
    code, _, body = c.request("GET", "/health", key=False)
    obs["health"] = {"status": code, "body": body.decode()[:40]}
    if key:
        code, _, body = c.request("GET", "/v1/models", key=False)
        obs["models_without_key"] = {"status": code, "body": _json(body)}
        code, _, body = c.request("POST", "/v1/chat/completions", {"model": served, "messages": []}, key=False)
        obs["chat_without_key"] = {"status": code, "body": _json(body)}
        code, _, body = c.request("GET", "/v1/models", key=False, headers={"Authorization": "Bearer wrong"})
        obs["models_wrong_key"] = {"status": code, "body": _json(body)}
        code, _, _ = c.request("GET", "/health", key=False, headers={"Authorization": "Bearer wrong"})
        obs["health_wrong_key"] = code
    code, _, body = c.request("GET", "/v1/models")
    doc = _json(body)
    card = doc["data"][0] if isinstance(doc, dict) and doc.get("data") else {}
    obs["models"] = {"status": code, "keys": sorted(doc) if isinstance(doc, dict) else doc,
                     "object": doc.get("object") if isinstance(doc, dict) else None,
                     "ids": [m.get("id") for m in doc.get("data", [])] if isinstance(doc, dict) else None,
                     "card_keys": sorted(card), "card_object": card.get("object"),
                     "owned_by": card.get("owned_by")}
    msgs = [{"role": "user", "content": "Count from 1 to 10."}]
    code, _, body = c.request("POST", "/v1/chat/completions",
                              {"model": served, "messages": msgs, "max_tokens": 4, "temperature": 0})
    doc = _json(body) or {}
    ch = (doc.get("choices") or [{}])[0]
    obs["chat"] = {"status": code, "object": doc.get("object"), "model": doc.get("model"),
                   "keys": sorted(k for k in doc if k in ("id", "object", "created", "model", "choices", "usage")),
                   "choice_keys": sorted(k for k in ch if k in ("index", "message", "logprobs", "finish_reason",
                                                                "stop_reason")),
                   "role": (ch.get("message") or {}).get("role"), "finish_reason": ch.get("finish_reason"),
                   "usage_keys": sorted(k for k in (doc.get("usage") or {})
                                        if k in ("prompt_tokens", "completion_tokens", "total_tokens")),
                   "completion_tokens": (doc.get("usage") or {}).get("completion_tokens"),
                   "id_prefix": str(doc.get("id", "")).split("-", 1)[0]}
    code, _, body = c.request("POST", "/v1/completions",
                              {"model": served, "prompt": "one two three", "max_tokens": 3, "temperature": 0})
    doc = _json(body) or {}
    ch = (doc.get("choices") or [{}])[0]
    obs["completion"] = {"status": code, "object": doc.get("object"), "finish_reason": ch.get("finish_reason"),
                         "text_is_str": isinstance(ch.get("text"), str),
                         "completion_tokens": (doc.get("usage") or {}).get("completion_tokens"),
                         "id_prefix": str(doc.get("id", "")).split("-", 1)[0]}
    code, _, body = c.request("POST", "/v1/chat/completions", {"model": "no-such-model", "messages": msgs})
    obs["unknown_model"] = _error_shape(code, body)
    obs["unknown_model"]["type"] = ((_json(body) or {}).get("error") or {}).get("type")
    code, _, body = c.request("POST", "/v1/chat/completions", {"model": served, "messages": msgs, "max_tokens": 0})
    obs["zero_max_tokens"] = {"status": code, "type": ((_json(body) or {}).get("error") or {}).get("type")}
    code, _, body = c.request("GET", "/v1/no-such-route")
    obs["unknown_route"] = {"status": code, "body": _json(body)}
    ev = c.stream("/v1/chat/completions", {"model": served, "messages": msgs, "max_tokens": 5, "temperature": 0,
                                           "stream": True, "stream_options": {"include_usage": True}})
    obs["chat_stream"] = {"shape": stream_shape(ev, chat=True), "token_chunks": token_chunks(ev, True),
                          "object": sorted({e.get("object") for e in ev if isinstance(e, dict)}),
                          "usage_completion_tokens": next((e["usage"].get("completion_tokens") for e in ev
                                                           if isinstance(e, dict) and e.get("usage")
                                                           and not e.get("choices")), None)}
    ev = c.stream("/v1/completions", {"model": served, "prompt": "one two three", "max_tokens": 3,
                                      "temperature": 0, "stream": True})
    obs["completion_stream"] = {"shape": stream_shape(ev, chat=False), "token_chunks": token_chunks(ev, False),
                                "object": sorted({e.get("object") for e in ev if isinstance(e, dict)})}
    code, headers, body = c.request("GET", "/metrics", key=False)
    text = body.decode(errors="replace")
    obs["metrics"] = {"status": code, "content_type": headers.get("content-type", "").split(";")[0],
                      "names": [m for m in METRICS if any(line.startswith(m) for line in text.splitlines())],
                      "ttft_histogram": "vllm:time_to_first_token_seconds_bucket" in text}
    return obs


class Readiness:
    """/health polled from before the engine starts until it answers: the answers seen, in order,
    repeats collapsed (the real vLLM refuses connections until it serves, then answers 200)."""

    def __init__(self, url: str, interval: float = 0.25, limit_s: float = 900.0):
        u = urlsplit(url)
        self.addr = (u.hostname, u.port or 80)
        self.interval, self.limit_s = interval, limit_s
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Readiness":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(10)

    def _one(self) -> str:
        try:
            c = http.client.HTTPConnection(*self.addr, timeout=2)
            c.request("GET", "/health")
            code = c.getresponse().status
            c.close()
            return str(code)
        except ConnectionRefusedError:
            return "refused"
        except (socket.timeout, TimeoutError):
            return "timeout"
        except OSError as e:
            return type(e).__name__

    def _run(self) -> None:
        end = time.monotonic() + self.limit_s
        while not self._stop.is_set() and time.monotonic() < end:
            s = self._one()
            if not self.seen or self.seen[-1] != s:
                self.seen.append(s)
            if s == "200":
                return
            self._stop.wait(self.interval)
