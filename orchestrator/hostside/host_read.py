"""What deployctl asks of a host's Docker engine, in one program per round trip: runs ON A HOST
(standard library only) as `python3 -c SOURCE SPEC`; three forms of SPEC:

  launch's read (launch/commands.py read_argv): the sections below;
  the container list (launch/commands.py list_argv: health, status, down): the host's clock, then
      `docker inspect` JSON of the deployment's containers, as the shell version printed it;
  a batch (executors/host_batch.py: preflight, ship, releases): {"batch": [argv, ...]}, each argv
      answered in turn, printed as one JSON list of {"rc", "out", "err"}.

One process instead of a shell script starting two interpreters and three docker processes: on a
connection with a command agent (orchestrator/executors/command_agent.py) a `python3 -c` request
runs in a fork of the agent, so reading a host starts no interpreter at all, and an engine on a unix
socket (the inventory's docker_host; the default) is asked through its API (EngineAPI) with the
answers the docker CLI gives. Any other engine URL gets the `docker -H ENGINE` commands (argv built by
executors/docker_cli.py), run without a shell. launch and status read every host at least once per
run, so at 8 hosts this is most of what a no-op `up` costs the hosts.

In a batch, a `docker -H unix://...` argv of a form whose output the CLI defines (cli_form: `info`,
`image inspect` and `container inspect` with a --format of {{.Field}} / {{json .Field}} actions,
`ps -q`, `image ls -q`, `tag`) is answered through the API as that CLI prints it (tests/test_engines.py
compares the two on Docker 20.10, 26 and 26 with the containerd store); every other argv (uname, df,
another engine, another form) runs as the process it names, without a shell.

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
import re
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

    def _get(self, url: str, method: str = "GET", timeout: float | None = None) -> tuple[int, bytes]:
        conn = _UnixHTTP(self.path, timeout or self.timeout)
        try:
            conn.request(method, url)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def json(self, url: str, method: str = "GET") -> tuple[int, object, str]:
        """(0, the answer's JSON, "") or (1, None, the CLI's error text)."""
        try:
            status, body = self._get(url, method)
        except OSError as e:
            return 1, None, self.down(e)
        if status // 100 != 2:
            return 1, None, "Error response from daemon: " + _message(body) + "\n"
        return 0, (json.loads(body) if body.strip() else None), ""

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


def engine_api(engine: str, timeout: float = 60.0) -> EngineAPI | None:
    """The API of ENGINE when it is a unix socket (asked directly); None: use the docker CLI."""
    return EngineAPI(engine, timeout) if engine.startswith("unix://") else None


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message") or body.decode(errors="replace"))
    except (ValueError, AttributeError):
        return body.decode(errors="replace").strip()


# -- a batch: docker CLI forms answered through the API ----------------------------------------------

ACTION = re.compile(r"\{\{\s*(json\s+)?\.([A-Za-z0-9_.]*)\s*\}\}")


def _go_json(value: object) -> str:
    """What Go's `json` template function prints: compact, <>& escaped, UTF-8 kept."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(fmt: str, doc: object) -> str | None:
    """FMT (only {{.A.B}} and {{json .A.B}} actions) over DOC, as Go's text/template prints it; None
    for a form this does not know (another action, a non-scalar printed without json)."""
    if "{{" in ACTION.sub("", fmt):
        return None
    out, pos = [], 0
    for m in ACTION.finditer(fmt):
        value = doc
        for key in filter(None, m.group(2).split(".")):
            value = value.get(key) if isinstance(value, dict) else None
        if m.group(1):
            text = _go_json(value)
        elif isinstance(value, str):
            text = value
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(value)
        else:
            return None
        out += [fmt[pos:m.start()], text]
        pos = m.end()
    return "".join(out) + fmt[pos:]


def _inspect(api: EngineAPI, kind: str, fmt: str, refs: list[str]) -> tuple[int, str, str] | None:
    """`docker image|container inspect --format FMT REFS...`: a line per ref, errors on stderr."""
    out, err = "", ""
    path = "/images/{}/json" if kind == "image" else "/containers/{}/json"
    for ref in refs:
        rc, doc, e = api.json(path.format(urllib.parse.quote(ref, safe="/:@")))
        if rc:
            if "Cannot connect" in e:
                return 1, out, err + e
            err += e
            continue
        line = render(fmt, doc)
        if line is None:
            return None
        out += line + "\n"
    return (1 if err else 0), out or "\n", err       # the CLI prints an empty line when none is found


def _split_ref(ref: str) -> tuple[str, str]:
    """'repo/name:tag' -> (repo/name, tag); no tag -> latest (as `docker tag` reads it)."""
    name, _, tag = ref.rpartition(":")
    if not name or "/" in tag:
        return ref, "latest"
    return name, tag


def _ps_form(args: list[str]) -> tuple[str, bool, bool] | None:
    """`ps -q [-a] [--no-trunc] --filter label=X` -> (X, all, no-trunc); None for any other form."""
    label, flags, it = None, set(), iter(args)
    for x in it:
        if x == "--filter" and label is None:
            f = next(it, "")
            if not f.startswith("label="):
                return None
            label = f[len("label="):]
        elif x in ("-q", "-a", "-aq", "--no-trunc"):
            flags.update({"-aq": {"-a", "-q"}}.get(x, {x}))
        else:
            return None
    if label is None or "-q" not in flags:
        return None
    return label, "-a" in flags, "--no-trunc" in flags


def cli_form(api: EngineAPI, args: list[str]) -> tuple[int, str, str] | None:
    """ARGS (after `docker -H ENGINE`) answered through the API as the CLI prints them, or None for
    a form not known here (then the CLI runs). The forms deployctl uses (see the module doc)."""
    a = list(args)
    if len(a) == 3 and a[0] == "info" and a[1] == "--format":
        rc, doc, err = api.json("/info")
        line = render(a[2], doc) if rc == 0 else ""
        return None if line is None else (rc, line + "\n" if rc == 0 else "", err)
    if len(a) >= 5 and a[0] in ("image", "container") and a[1] == "inspect" and a[2] == "--format":
        return _inspect(api, a[0], a[3], a[4:])
    if len(a) == 3 and a[0] == "tag":
        repo, tag = _split_ref(a[2])
        q = urllib.parse.urlencode({"repo": repo, "tag": tag})
        rc, _, err = api.json(f"/images/{urllib.parse.quote(a[1], safe='/:@')}/tag?{q}", "POST")
        return rc, "", err
    if a[:1] == ["ps"]:
        ps = _ps_form(a[1:])
        if ps is not None:
            label, every, full = ps
            q = {"filters": json.dumps({"label": [label]}), **({"all": "1"} if every else {})}
            rc, docs, err = api.json("/containers/json?" + urllib.parse.urlencode(q))
            return rc, "".join((d["Id"] if full else d["Id"][:12]) + "\n" for d in docs or []), err
    if a == ["image", "ls", "-aq", "--no-trunc"]:
        # one line per image (the CLI repeats an ID once per extra tag; callers take the set)
        rc, docs, err = api.json("/images/json?all=1")
        return rc, "".join(d["Id"] + "\n" for d in docs or []), err
    return None


def answer(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """One argv of a batch: through the API when it is a known CLI form on a unix:// engine."""
    api = engine_api(argv[2], timeout) if len(argv) > 3 and argv[:2] == ["docker", "-H"] else None
    got = cli_form(api, argv[3:]) if api is not None else None
    if got is not None:
        return got
    p = docker(argv, timeout)
    return p.returncode, p.stdout, p.stderr


def batch(spec: dict) -> int:
    """Each argv in turn; {"argv": [...], "ids_from": K}: K's output words appended (none: skipped)."""
    results: list[dict] = []
    for item in spec["batch"]:
        argv = item if isinstance(item, list) else item["argv"]
        if isinstance(item, dict) and "ids_from" in item:
            ids = results[item["ids_from"]]["out"].split()
            if not ids:
                results.append({"rc": 0, "out": "", "err": ""})
                continue
            argv = argv + sorted(set(ids), key=ids.index)
        rc, out, err = answer(argv, spec.get("timeout", 60.0))
        results.append({"rc": rc, "out": out, "err": err})
    sys.stdout.write(json.dumps(results))
    return 0


def list_containers(spec: dict) -> int:
    """The container list (see the module doc); exit 3 when the engine does not answer."""
    api = engine_api(spec.get("engine", ""))
    sys.stdout.write(f"{int(time.time())}\n")
    return _containers(api, spec)


def main(spec: dict) -> int:
    w = sys.stdout.write
    w("@@facts\n")
    if spec["facts_args"]:
        w(run_script(spec["facts"], spec["facts_args"]))
    w("@@staged\n")
    w(run_script(spec["staged"], spec["staged_args"]))
    api = engine_api(spec.get("engine", ""))
    if api is not None:
        rc, text = api.image_id(spec["image"])
    else:
        img = docker(spec["image_inspect"])
        rc, text = img.returncode, img.stdout + img.stderr
    w("@@image\n" + text + f"exit {rc}\n")
    w("@@containers\n" + f"{int(time.time())}\n")
    return _containers(api, spec)


def _containers(api: EngineAPI | None, spec: dict) -> int:
    w = sys.stdout.write
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
    _spec = json.loads(sys.argv[1])
    sys.exit(batch(_spec) if "batch" in _spec else list_containers(_spec) if _spec.get("list") else main(_spec))
