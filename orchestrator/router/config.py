"""all.vars.router: where the router runs, its ports and its client key (pure)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

KEYS = {
    "host": "the inventory host the router runs on (default: the first deployment's head)",
    "port": "its OpenAI API port (default 30000)",
    "listen": "the address it listens on (default: the host's management address; 0.0.0.0 for every interface)",
    "metrics_port": "its Prometheus /metrics port, on the same address (default 29000)",
    "backend_port": "with a client key, the port the router itself listens on at 127.0.0.1, behind deployctl's "
                    "key check on its address and port (default: port + 1)",
    "api_key_file": "file on the controller holding the key clients send to the router (relative: to this "
                    "inventory); required when a deployment has a key",
    "api_key_env": "or: the environment variable holding it",
    "image": "the router image (default deployctl-router:0.3.2, built on the router host from "
             "dockerfiles/chains/router.yml when missing)",
    "check_interval_s": "how often the router's keeper checks each deployment's /health (default 2)",
}
DEFAULT_IMAGE = "deployctl-router:0.3.2"
CHAIN = "router"


@dataclass(frozen=True)
class RouterConf:
    host: Any                           # the inventory's Host (inventory.py builds it)
    port: int = 30000
    listen: str | None = None           # None: the host's management address
    metrics_port: int = 29000
    backend_port: int | None = None     # None: port + 1 (the router behind the key check: 127.0.0.1)
    api_key_file: str | None = None
    api_key_env: str | None = None
    image: str = DEFAULT_IMAGE
    check_interval_s: float = 2.0

    @property
    def address(self) -> str:
        return self.listen or self.host.address

    @property
    def backend(self) -> int:
        """The router's own port on 127.0.0.1 when its clients need a key (hostside/router_front.py)."""
        return self.backend_port or self.port + 1

    @property
    def url(self) -> str:
        """Where clients (and the controller) reach it."""
        a = self.host.address if self.address in ("0.0.0.0", "::") else self.address
        return f"http://{'[' + a + ']' if ':' in a else a}:{self.port}"


def parse(raw: Any, default_host: str, host_of: Callable[[str], Any], err: Callable[[str, str], Exception],
          resolve_path: Callable[[str], str]) -> RouterConf:
    """RAW (all.vars.router) -> RouterConf; ERR(message, key) makes the exit-2 error naming the key."""
    key = "all.vars.router"
    if raw is True:
        raw = {}
    if not isinstance(raw, dict):
        raise err("expected a mapping (host, port, api_key_file, ...) or true", key)
    for k in raw:
        if k not in KEYS:
            raise err(f"unknown key {k!r} (the router sets: {', '.join(KEYS)})", f"{key}.{k}")
    name = str(raw.get("host", default_host))
    host = host_of(name)
    out: dict[str, Any] = {"host": host}
    for k in ("port", "metrics_port", "backend_port"):
        if k in raw:
            v = raw[k]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
                raise err(f"expected a TCP port number, got {v!r}", f"{key}.{k}")
            out[k] = v
    if out.get("port", 30000) == out.get("metrics_port", 29000):
        raise err("the API and metrics ports must differ", f"{key}.metrics_port")
    backend = out.get("backend_port", out.get("port", 30000) + 1)
    if backend in (out.get("port", 30000), out.get("metrics_port", 29000)):
        raise err(f"the router's backend port {backend} must differ from its API and metrics ports",
                  f"{key}.backend_port")
    if "listen" in raw:
        if not isinstance(raw["listen"], str) or not raw["listen"].strip():
            raise err(f"expected an address, got {raw['listen']!r}", f"{key}.listen")
        out["listen"] = raw["listen"]
    if "api_key_file" in raw and "api_key_env" in raw:
        raise err("set api_key_file or api_key_env, not both", f"{key}.api_key_env")
    if "api_key_file" in raw:
        if not isinstance(raw["api_key_file"], str) or not raw["api_key_file"].strip():
            raise err(f"expected a file path, got {raw['api_key_file']!r}", f"{key}.api_key_file")
        out["api_key_file"] = resolve_path(raw["api_key_file"])
    if "api_key_env" in raw:
        v = raw["api_key_env"]
        if not (isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v)):
            raise err(f"expected an environment variable name, got {v!r}", f"{key}.api_key_env")
        out["api_key_env"] = v
    if "image" in raw:
        if not isinstance(raw["image"], str) or not re.fullmatch(r"[^\s]+", raw["image"]):
            raise err(f"expected an image reference, got {raw['image']!r}", f"{key}.image")
        out["image"] = raw["image"]
    if "check_interval_s" in raw:
        v = raw["check_interval_s"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.2 <= v <= 60:
            raise err(f"expected seconds between 0.2 and 60, got {v!r}", f"{key}.check_interval_s")
        out["check_interval_s"] = float(v)
    return RouterConf(**out)
