"""The engine's OpenAI-style API on the head, checked the way the vendor reports did:
GET /health (200), GET /v1/models (lists the served name), then a real chat completion.

Every request has a timeout; proxies from the environment are ignored (the head is a cluster address).
With an API key (orchestrator/apikey.py) every request sends `Authorization: Bearer <key>`; an HTTP 401
or 403 is reported as the API rejecting the key (`ApiCheck.rejected`), never as an unhealthy engine.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..apikey import ApiKey
from ..hostside import metrics

if TYPE_CHECKING:
    import httpx

QUICK_TIMEOUT_S = 10.0       # /health and /v1/models answer at once when the engine is up

# Engine log lines that tell how far start-up got (vLLM, SGLang, NCCL, the engine double).
_PROGRESS = re.compile(r"\d+(\.\d+)?\s*%|\d+/\d+|loading|loaded|captur|compil|rendezvous|joined|"
                       r"waiting|download|warm|nccl|init|startup|ready", re.I)


@dataclass(frozen=True)
class ApiCheck:
    ok: bool
    step: str                # the step reached: health | models | chat | done
    detail: str
    fatal: bool = False      # the engine answers but can never pass (e.g. wrong served name)
    rejected: bool = False   # HTTP 401/403: the engine is up and refuses deployctl's key (or its lack of one)


def _rejected(step: str, what: str, r: httpx.Response, key: ApiKey | None) -> ApiCheck:
    if key is None:
        why = ("the API requires a key and deployctl has none: set api_key_file or api_key_env in the "
               "inventory")
    else:
        why = (f"the API rejects the key ({key.describe()}): the engines run with another key; fix the "
               "inventory's key, or relaunch (`deployctl launch`) to give them this one")
    return ApiCheck(False, step, f"{why} (HTTP {r.status_code} on {what})", rejected=True)


def check(client: httpx.Client, base: str, served: str, prompt: str | None, max_tokens: int,
          request_timeout: float, key: ApiKey | None = None) -> ApiCheck:
    """One pass over the checks; stops at the first that does not pass. PROMPT None: no completion.
    CLIENT sends the key (http_client(key)); KEY only words the message when the API refuses it."""
    import httpx
    quick = min(QUICK_TIMEOUT_S, request_timeout)
    try:
        r = client.get(f"{base}/health", timeout=quick)
    except httpx.HTTPError as e:
        return ApiCheck(False, "health", f"GET /health: {_why(e)}")
    if r.status_code in (401, 403):
        return _rejected("health", "GET /health", r, key)
    if r.status_code != 200:
        return ApiCheck(False, "health", f"GET /health: HTTP {r.status_code} {r.text[:200].strip()}")
    try:
        r = client.get(f"{base}/v1/models", timeout=quick)
        names = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        return ApiCheck(False, "models", f"GET /v1/models: {_why(e)}")
    if r.status_code in (401, 403):
        return _rejected("models", "GET /v1/models", r, key)
    if names is None:
        return ApiCheck(False, "models", f"GET /v1/models: HTTP {r.status_code} {r.text[:200].strip()}")
    if served not in names:
        return ApiCheck(False, "models", f"GET /v1/models lists {names}, not the served name {served!r}",
                        fatal=True)
    if prompt is None:
        return ApiCheck(True, "models", f"/health 200, /v1/models lists {served}")
    body = {"model": served, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    t0 = time.monotonic()
    try:
        r = client.post(f"{base}/v1/chat/completions", json=body, timeout=request_timeout)
        doc = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return ApiCheck(False, "chat", f"POST /v1/chat/completions: {_why(e)}")
    if r.status_code in (401, 403):
        return _rejected("chat", "POST /v1/chat/completions", r, key)
    if r.status_code != 200:
        msg = (doc.get("error") or {}).get("message") if isinstance(doc, dict) else None
        return ApiCheck(False, "chat", f"POST /v1/chat/completions: HTTP {r.status_code} {msg or r.text[:200]}")
    try:
        text = doc["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        text = ""
    if not text.strip():
        return ApiCheck(False, "chat", f"POST /v1/chat/completions returned no text: {str(doc)[:200]}")
    took = time.monotonic() - t0
    return ApiCheck(True, "done", f"/health 200, /v1/models lists {served}, chat answered "
                                  f"{_quote(text)} in {took:.1f}s")


def _why(e: Exception) -> str:
    import httpx
    if isinstance(e, httpx.ConnectError):
        return "connection refused or unreachable (engine still loading?)"
    if isinstance(e, httpx.TimeoutException):
        return f"no answer in time ({type(e).__name__})"
    return f"{type(e).__name__}: {e}"


def _quote(text: str, n: int = 60) -> str:
    one = " ".join(text.split())
    return repr(one if len(one) <= n else one[:n] + "...")


def progress_line(lines: list[str]) -> str:
    """The last line of an engine log that tells how far start-up got ("Loading weights: 40%")."""
    for line in reversed(lines):
        if _PROGRESS.search(line):
            return line.strip()[-200:]
    return lines[-1].strip()[-200:] if lines else ""


def in_flight(client: httpx.Client, base: str, timeout: float = QUICK_TIMEOUT_S) -> dict[str, int] | None:
    """{"running": N, "waiting": M} from the engine's /metrics (summed over its label sets); None when
    it does not answer or reports neither."""
    import httpx
    try:
        r = client.get(base.rstrip("/") + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return metrics.in_flight(r.text)


def http_client(key: ApiKey | None = None) -> httpx.Client:
    """A client for the deployment's API; with KEY every request carries `Authorization: Bearer`.
    httpx is imported here, not with the module: `status` asks the API while it waits for the hosts."""
    import httpx
    # The deployment's API is plain http:// (Deployment.api_url) and redirects are not followed, so
    # no request can reach TLS: no context to build (loading the CA bundle costs ~0.1 s of CPU per client).
    return httpx.Client(trust_env=False, follow_redirects=False, headers=key.headers if key else None, verify=False)
