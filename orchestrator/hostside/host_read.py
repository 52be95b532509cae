"""What launch, status and releases read from a host, in one program: runs ON A HOST (standard library
only) as `python3 -c SOURCE SPEC` (orchestrator/launch/commands.py read_argv builds it).

One process instead of a shell script starting two interpreters and three docker processes: on a
connection with a command agent (orchestrator/executors/command_agent.py) a `python3 -c` request
runs in a fork of the agent, so reading a host starts no interpreter at all, and an engine on a unix
socket (the inventory's docker_host; the default) is asked through its API (EngineAPI) with the
answers the docker CLI gives. Any other engine URL gets the `docker -H ENGINE` commands (argv built by
executors/docker_cli.py), run without a shell. launch and status read every host at least once per
run, so at 8 hosts this is most of what a no-op `up` costs the hosts.

SPEC (argv[1], JSON): facts, staged (the two scripts, each run as `python3 -c SCRIPT ARGS` would run
it: a fresh __main__, its own sys.argv, its stdout captured), facts_args ([] on one node: no network
facts), staged_args, engine, image, label, and the CLI's argv for the same questions: image_inspect,
ps, inspect (as list_argv's shell did: ids of every container with the label, then `docker inspect`).

Prints the sections launch/probe.py read_host parses, as the shell version did:
  @@facts / @@staged  the script's output, or its error and "exit N"
  @@image             the image ID, or docker's error; then "exit N"
  @@containers        the host's clock (epoch seconds), then `docker inspect` JSON (or nothing)
Exit 3 when the engine does not answer (docker ps failed), as list_argv's shell did.
"""
from __future__ import annotations

import contextlib
import http.client
import io
import json
import socket
import subprocess
import sys
import time
import traceback
import urllib.parse


def run_script(source: str, args: list[str]) -> str:
    """SOURCE as `python3 -c SOURCE ARGS...` would run it; its stdout, or its error and "exit N"."""
    out, saved = io.StringIO(), sys.argv
    sys.argv = ["-c", *args]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, "<string>", "exec", dont_inherit=True), {"__name__": "__main__"})
        return out.getvalue()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return out.getvalue() + ("" if code == 0 else f"exit {code}\n")
    except Exception:  # noqa: BLE001 - reported in the section, as the shell's `|| echo "exit $?"` did
        return out.getvalue() + traceback.format_exc(limit=2) + "exit 1\n"
    finally:
        sys.argv = saved


def docker(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: {e}\n")


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


class EngineAPI:
    """The three questions asked of a `unix://` engine through its API, answered as the docker CLI
    answers them (`image inspect --format {{.Id}}`, `ps -aq --no-trunc --filter`, `inspect`: the
    CLI prints the API's JSON as it comes) without starting a docker process per question. The
    unversioned paths take the engine's own API version (Engine API as moby/moby api/swagger.yaml
    defines it: ImageInspect GET /images/{name}/json, ContainerList GET /containers/json with `all`
    and `filters`, ContainerInspect GET /containers/{id}/json; the same in API 1.41 (20.10) and
    1.45 (26), the two engines the tests run)."""

    def __init__(self, engine: str, timeout: float = 60.0):
        self.engine, self.path, self.timeout = engine, engine[len("unix://"):], timeout

    def _get(self, url: str) -> tuple[int, bytes]:
        conn = _UnixHTTP(self.path, self.timeout)
        try:
            conn.request("GET", url)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def down(self, e: OSError) -> str:     # the CLI's words, which operators and tests look for
        return (f"Cannot connect to the Docker daemon at {self.engine}. Is the docker daemon running? "
                f"({e})\n")

    def image_id(self, ref: str) -> tuple[int, str]:
        try:
            status, body = self._get(f"/images/{urllib.parse.quote(ref, safe='/:@')}/json")
        except OSError as e:
            return 1, self.down(e)
        if status == 200:
            return 0, json.loads(body)["Id"] + "\n"
        return 1, "Error response from daemon: " + _message(body) + "\n"

    def container_ids(self, label: str) -> tuple[int, list[str], str]:
        q = urllib.parse.urlencode({"all": "1", "filters": json.dumps({"label": [label]})})
        try:
            status, body = self._get(f"/containers/json?{q}")
        except OSError as e:
            return 1, [], self.down(e)
        if status != 200:
            return 1, [], "Error response from daemon: " + _message(body) + "\n"
        return 0, [c["Id"] for c in json.loads(body)], ""

    def inspect(self, ids: list[str]) -> tuple[int, str, str]:
        docs, err = [], ""
        for cid in ids:
            try:
                status, body = self._get(f"/containers/{cid}/json")
            except OSError as e:
                return 1, "", self.down(e)
            if status == 200:
                docs.append(json.loads(body))
            else:                               # gone between ps and inspect: as the CLI, rc 1
                err += "Error response from daemon: " + _message(body) + "\n"
        return (1 if err else 0), json.dumps(docs), err


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message") or body.decode(errors="replace"))
    except (ValueError, AttributeError):
        return body.decode(errors="replace").strip()


def main(spec: dict) -> int:
    w = sys.stdout.write
    w("@@facts\n")
    if spec["facts_args"]:
        w(run_script(spec["facts"], spec["facts_args"]))
    w("@@staged\n")
    w(run_script(spec["staged"], spec["staged_args"]))
    api = EngineAPI(spec["engine"]) if spec.get("engine", "").startswith("unix://") else None
    if api is not None:
        rc, text = api.image_id(spec["image"])
    else:
        img = docker(spec["image_inspect"])
        rc, text = img.returncode, img.stdout + img.stderr
    w("@@image\n" + text + f"exit {rc}\n")
    w("@@containers\n" + f"{int(time.time())}\n")
    if api is not None:
        rc, ids, err = api.container_ids(spec["label"])
    else:
        ps = docker(spec["ps"])
        rc, ids, err = ps.returncode, ps.stdout.split(), ps.stderr
    if rc != 0:
        sys.stderr.write(err)
        return 3
    if not ids:
        return 0
    if api is not None:
        rc, out, err = api.inspect(ids)
    else:
        ins = docker(spec["inspect"] + ids)
        rc, out, err = ins.returncode, ins.stdout, ins.stderr
    w(out + "\n")
    sys.stderr.write(err)
    return rc


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
