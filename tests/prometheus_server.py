"""A real Prometheus (Debian's prometheus, installed by .ci/setup) for the tests: started on a generated
configuration folder, asked through its HTTP API (/api/v1/query, /api/v1/targets, /api/v1/alerts:
prometheus/docs content/docs/prometheus/latest/querying/api.md), stopped at the end."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, config: Path, data: Path):
        self.config, self.data = config, data
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus (.ci/setup installs it)"
        self.data.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.data}",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait("Prometheus ready", lambda: self._get("/-/ready", raw=True) is not None, 60)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def _get(self, path: str, raw: bool = False, **params: str) -> Any:
        q = ("?" + urllib.parse.urlencode(params)) if params else ""
        try:
            with urllib.request.urlopen(self.url + path + q, timeout=10) as r:
                body = r.read()
        except OSError:
            return None
        return body if raw else json.loads(body)

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def wait(self, what: str, check: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
        end = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not within {timeout:g}s\n{self.log_tail()}")
            time.sleep(every)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector; an expression Prometheus refuses is an AssertionError."""
        doc = self._get("/api/v1/query", query=expr)
        assert doc is not None, f"no answer from Prometheus for {expr!r}"
        assert doc.get("status") == "success", (expr, doc)
        return doc["data"]["result"]

    def value(self, expr: str) -> float | None:
        r = self.query(expr)
        return float(r[0]["value"][1]) if r else None

    def targets(self) -> list[dict[str, Any]]:
        doc = self._get("/api/v1/targets", state="active")
        return (doc or {}).get("data", {}).get("activeTargets", [])

    def alerts(self, name: str) -> list[dict[str, Any]]:
        doc = self._get("/api/v1/alerts") or {}
        return [a for a in doc.get("data", {}).get("alerts", []) if a["labels"].get("alertname") == name]

    def reload(self) -> None:
        req = urllib.request.Request(self.url + "/-/reload", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass
