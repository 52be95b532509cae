"""health: the API really answers (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    head, r = dep.cluster.head_host, dep.recipe
    base = dep.api_url
    act = Action("health", head.name, "http-checks",
                 f"wait for {base}/health, {r.engine.served_name} in /v1/models, a chat completion",
                 api=f"GET {base}/health; GET {base}/v1/models; POST {base}/v1/chat/completions "
                     f"{{\"messages\": [{{\"role\": \"user\", \"content\": \"{r.health.prompt}\"}}], "
                     f"\"max_tokens\": {r.health.max_tokens}}}")
    return [act], ""


STAGE = Stage("health", plan, not_implemented("health", "launch issue"),
              "check the API until it really answers")
