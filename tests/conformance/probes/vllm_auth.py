"""Which requests the released vLLM serves when an API key is set: its own AuthenticationMiddleware
(vllm/entrypoints/serve/middleware/authenticate.py) called on each case, the app behind it recording
whether the request got through.

stdin:  {"keys": ["k1", ...], "cases": [{"method": "GET", "path": "/health", "authorization": null}, ...]}
stdout: {"vllm_version": "...", "allowed": [true | false, ...], "status": [null | 401, ...]}
"""
from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run  # noqa: E402


def probe(payload: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    async def one(case: dict[str, Any]) -> tuple[bool, int | None]:
        passed, sent = [], []

        async def app(scope, receive, send):
            passed.append(True)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg):
            if msg["type"] == "http.response.start":
                sent.append(msg["status"])

        headers = [(b"authorization", case["authorization"].encode())] if case.get("authorization") else []
        scope = {"type": "http", "method": case["method"], "path": case["path"], "root_path": "",
                 "headers": headers, "query_string": b""}
        await AuthenticationMiddleware(app, tokens=payload["keys"])(scope, receive, send)
        return bool(passed), (sent[0] if sent else None)

    results = [asyncio.run(one(c)) for c in payload["cases"]]
    return {"vllm_version": vllm.__version__, "allowed": [a for a, _ in results],
            "status": [s for _, s in results]}


if __name__ == "__main__":
    run(probe)
