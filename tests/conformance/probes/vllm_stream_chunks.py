"""Which streamed chat chunks the released vLLM's own benchmark counts as a generated token
(vllm/benchmarks/lib/endpoint_request_func.py `_choice_has_streamed_output`, the rule of its TTFT
and ITL in `vllm bench serve`).

stdin:  {"choices": [{"delta": {...}}, ...]}
stdout: {"vllm_version": "...", "token": [true | false, ...]}
"""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run  # noqa: E402


def probe(payload: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm.benchmarks.lib.endpoint_request_func import _choice_has_streamed_output
    return {"vllm_version": vllm.__version__,
            "token": [bool(_choice_has_streamed_output(c)) for c in payload["choices"]]}


if __name__ == "__main__":
    run(probe)
