"""The supervisor's engine client (hostside/supervisor.py): the Docker engine API over the host's socket, as
the supervisor and the agents read a rank: its container, its generations, its exit, its log tail."""

from __future__ import annotations

import json
import signal
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from .host_read import EngineAPI

SOCKET = "/run/deployctl/docker.sock"    # the host's Docker socket, mounted here
ENGINE_LABEL = "deployctl.deployment"     # the engines' label (launch/containers.py)
TABLES_LABEL = "deployctl.tables"         # the staged tables' digests a rank maps (launch/containerspec.py)
PREVIOUS_SUFFIX = "-prev"                 # the generation an up replaced, kept stopped (launch/containers.py)
LOG_TAIL = 30


class Engine(EngineAPI):
    """The Docker Engine API over the mounted socket (moby api/swagger.yaml: ContainerList,
    ContainerInspect, ContainerStop, ContainerStart, ContainerLogs; unversioned paths)."""

    def __init__(self, path: str = SOCKET, timeout: float = 30.0):
        super().__init__(f"unix://{path}", timeout)

    def _call(self, method: str, url: str, timeout: float | None = None) -> tuple[int, bytes]:
        return self._get(url, method, timeout)

    def containers(self, deployment: str) -> list[dict[str, Any]]:
        """The deployment's engine containers (any state), inspected."""
        q = urllib.parse.urlencode({"all": "1", "filters": json.dumps({"label": [f"{ENGINE_LABEL}={deployment}"]})})
        status, body = self._call("GET", f"/containers/json?{q}")
        if status != 200:
            raise OSError(f"docker ps: HTTP {status}: {body[:200]!r}")
        out = []
        for c in json.loads(body):
            st, doc = self._call("GET", f"/containers/{c['Id']}/json")
            if st == 200:
                out.append(json.loads(doc))
        return out

    def stop(self, cid: str, t: int) -> None:
        status, body = self._call("POST", f"/containers/{cid}/stop?t={t}", timeout=t + 30)
        if status not in (204, 304):
            raise OSError(f"docker stop {cid[:12]}: HTTP {status}: {body[:200]!r}")

    def start(self, cid: str) -> None:
        status, body = self._call("POST", f"/containers/{cid}/start", timeout=120)
        if status not in (204, 304):
            raise OSError(f"docker start {cid[:12]}: HTTP {status}: {body[:200]!r}")

    def remove(self, cid: str) -> None:
        status, body = self._call("DELETE", f"/containers/{cid}?force=1", timeout=60)
        if status not in (204, 404):
            raise OSError(f"docker rm {cid[:12]}: HTTP {status}: {body[:200]!r}")

    def rename(self, cid: str, name: str) -> None:
        status, body = self._call("POST", f"/containers/{cid}/rename?{urllib.parse.urlencode({'name': name})}")
        if status != 204:
            raise OSError(f"docker rename {cid[:12]} {name}: HTTP {status}: {body[:200]!r}")

    def logs_tail(self, cid: str, n: int = LOG_TAIL) -> list[str]:
        status, body = self._call("GET", f"/containers/{cid}/logs?stdout=1&stderr=1&tail={n}")
        if status != 200:
            return [f"(its log could not be read: HTTP {status})"]
        return demux(body).decode(errors="replace").splitlines()[-n:]


def demux(raw: bytes) -> bytes:
    """A non-TTY container's log stream: 8-byte frame headers (stream, 0, 0, 0, size BE32) + payload."""
    out, i = bytearray(), 0
    while i + 8 <= len(raw) and raw[i] in (0, 1, 2) and raw[i + 1:i + 4] == b"\0\0\0":
        size = int.from_bytes(raw[i + 4:i + 8], "big")
        out += raw[i + 8:i + 8 + size]
        i += 8 + size
    return bytes(out) if i else raw


@dataclass
class RankView:
    """One rank as last seen: its container (None: no container of the deployment on that host)."""
    host: str
    container: dict[str, Any] | None
    boot_id: str = ""
    mem_kib: int | None = None
    age_s: float = 0.0                  # since the report (0 for the head's own rank)
    log_tail: list[str] = field(default_factory=list)
    disk_avail: int | None = None       # bytes free where the state folder is (the host's NVMe folder)
    previous: dict[str, Any] | None = None      # the generation an up replaced, kept stopped (rollback)

    @property
    def running(self) -> bool:
        return bool(self.container) and self.container.get("status") == "running"


def container_view(doc: dict[str, Any]) -> dict[str, Any]:
    st = doc.get("State") or {}
    labels = (doc.get("Config") or {}).get("Labels") or {}
    return {"id": doc.get("Id", ""), "name": (doc.get("Name") or "").lstrip("/"),
            "status": st.get("Status", ""), "exit_code": int(st.get("ExitCode") or 0),
            "oom_killed": bool(st.get("OOMKilled")), "error": st.get("Error") or "",
            "started_at": st.get("StartedAt", ""), "finished_at": st.get("FinishedAt", ""),
            "spec": labels.get("deployctl.spec", ""), "image": doc.get("Image", ""),
            "tables": labels.get(TABLES_LABEL, "")}


def exit_text(c: dict[str, Any]) -> str:
    code = c.get("exit_code", 0)
    sig = ""
    if code > 128:
        try:
            sig = f" ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    oom = ", OOM-killed by the kernel" if c.get("oom_killed") else ""
    err = f", {c['error']}" if c.get("error") else ""
    return f"{c.get('status')} with exit code {code}{sig}{oom}{err}"
