"""Which requests the released SGLang serves when an API key is set (its pure decision function,
sglang/srt/utils/auth.py decide_request_auth, at the normal auth level the OpenAI routes use), and
the api_key its server arguments get from a `--config` YAML file (server_args.prepare_server_args).

stdin:  {"key": "k", "cases": [{"method": ..., "path": ..., "authorization": ...}, ...],
         "argv": ["--model-path", M, ..., "--config", FILE]}      # argv optional
stdout: {"sglang_version": "...", "allowed": [...], "status": [...], "api_key": "k" | null}
"""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run  # noqa: E402


def probe(payload: dict[str, Any]) -> dict[str, Any]:
    import sglang
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    allowed, status = [], []
    for c in payload["cases"]:
        d = decide_request_auth(method=c["method"], path=c["path"], authorization_header=c.get("authorization"),
                                api_key=payload["key"], admin_api_key=None, auth_level=AuthLevel.NORMAL)
        allowed.append(bool(d.allowed))
        status.append(None if d.allowed else d.error_status_code)
    api_key = None
    if payload.get("argv"):
        from sglang.srt.server_args import prepare_server_args
        api_key = prepare_server_args(list(payload["argv"])).api_key
    return {"sglang_version": sglang.__version__, "allowed": allowed, "status": status, "api_key": api_key}


if __name__ == "__main__":
    run(probe)
