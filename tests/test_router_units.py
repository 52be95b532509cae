"""The router's pure parts (docs/router.md): all.vars.router's parsing and refusals, the keeper's
reconciliation (what it deletes and posts), the install identity, and the router's argv as the
released sglang-router parses it (its own parse_router_args, in the router image)."""
from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.colocation import router_clashes
from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.hostside import router_keeper as rk
from orchestrator.inventory import InventoryRef, load_inventory
from orchestrator.router import control, layout

HOSTS = {f"n{i}": {"ansible_host": f"10.9.0.{i}", "hardware": "dgx-spark", "nvme_dir": "/nvme",
                   "model_cache": "/models"} for i in (1, 2, 3)}


def _inv(tmp_path: Path, router, **deps) -> Path:
    deps = deps or {"big": {"hosts": ["n1"], "recipe": "qwen38-flash-next-spark", "api_port": 8000},
                    "small": {"hosts": ["n3"], "recipe": "qwen38-flash-next-spark", "api_port": 8001}}
    doc = {"all": {"vars": {"deployments": deps, **({"router": router} if router is not None else {})},
                   "hosts": HOSTS}}
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_defaults_and_the_host_it_names(tmp_path):
    (tmp_path / "r.key").write_text("sk-router-0123456789\n")
    c = load_inventory(InventoryRef.of(_inv(tmp_path, {"api_key_file": "r.key"}), "small"))
    r = c.router
    assert r.host.name == "n1" and r.port == 30000 and r.metrics_port == 29000      # the first deployment's head
    assert r.url == "http://10.9.0.1:30000" and r.api_key_file == str(tmp_path / "r.key")
    assert load_inventory(InventoryRef.of(_inv(tmp_path, {"host": "n3", "port": 9000}), "big")).router.url == \
        "http://10.9.0.3:9000"
    assert load_inventory(InventoryRef.of(_inv(tmp_path, True), "big")).router.port == 30000
    assert load_inventory(InventoryRef.of(_inv(tmp_path, None), "big")).router is None


@pytest.mark.parametrize("router, key, words", [
    ({"host": "n9"}, "all.vars.router.host", "'n9' is not a host"),
    ({"port": 0}, "all.vars.router.port", "TCP port"),
    ({"port": 9000, "metrics_port": 9000}, "all.vars.router.metrics_port", "must differ"),
    ({"colour": "red"}, "all.vars.router.colour", "unknown key"),
    ({"api_key_file": "a", "api_key_env": "B"}, "all.vars.router.api_key_env", "not both"),
    ({"check_interval_s": 0}, "all.vars.router.check_interval_s", "between"),
    ("yes", "all.vars.router", "expected a mapping"),
])
def test_bad_router_settings_name_their_key(tmp_path, router, key, words):
    with pytest.raises(InputError) as e:
        load_inventory(InventoryRef.of(_inv(tmp_path, router), "big"))
    assert e.value.key == key and words in str(e.value) and e.value.exit_code == 2


def test_a_keyed_deployment_behind_an_open_router_is_refused(tmp_path):
    (tmp_path / "e.key").write_text("sk-engine-0123456789\n")
    inv = _inv(tmp_path, {"host": "n3"}, solo={"hosts": ["n3"], "recipe": "qwen38-flash-next-spark",
                                               "api_port": 8001, "api_key_file": "e.key"})
    dep = load_deployment(InventoryRef.of(inv, "solo"))
    with pytest.raises(InputError) as e:
        control.check(dep)
    assert e.value.key == "all.vars.router.api_key_file" and "admit anyone" in str(e.value)


def test_router_ports_clash_with_a_deployment_on_its_host(tmp_path):
    inv = _inv(tmp_path, {"host": "n3", "port": 8001})
    with pytest.raises(InputError) as e:
        load_deployment(InventoryRef.of(inv, "small"))
    assert "port 8001 is the API of deployment small and the router's API" in str(e.value)
    dep = load_deployment(InventoryRef.of(_inv(tmp_path, {"host": "n3", "port": 8002}), "small"))
    assert router_clashes(dep) == []


def test_worker_entry_and_install_identity(tmp_path):
    (tmp_path / "e.key").write_text("sk-engine-0123456789\n")
    inv = _inv(tmp_path, {"host": "n3", "api_key_file": "e.key"},
               solo={"hosts": ["n3"], "recipe": "qwen38-flash-next-spark", "api_port": 8001, "api_key_file": "e.key"})
    dep = load_deployment(InventoryRef.of(inv, "solo"))
    w = layout.worker(dep)
    assert w == {"deployment": "solo", "model": dep.recipe.engine.served_name, "url": "http://10.9.0.3:8001",
                 "api_key": "sk-engine-0123456789"}
    conf = dep.cluster.router
    a = layout.install_id(conf, "sha256:1", "k1")
    assert a == layout.install_id(conf, "sha256:1", "k1")
    assert len({a, layout.install_id(conf, "sha256:2", "k1"), layout.install_id(conf, "sha256:1", "k2")}) == 3
    argv = layout.run_argv(conf, a, "inv")
    assert "sk-engine-0123456789" not in " ".join(argv) and argv[argv.index("--entrypoint") + 1] == "python3"
    assert argv[-3:] == ["router", "launch", "/state/config.json"] and "/nvme/.deployctl/router:/state" in argv
    assert argv[argv.index("--cap-add") + 1] == "SYS_PTRACE" and argv.count("--cap-add") == 1   # nodelay() only


A = {"deployment": "a", "model": "ma", "url": "http://h:1", "api_key": "k"}
B = {"deployment": "b", "model": "mb", "url": "http://h:2"}


def test_keeper_posts_the_healthy_and_deletes_the_rest():
    # nothing registered: only the healthy one is posted
    assert rk.changes([A, B], {A["url"]: True, B["url"]: False}, [], {}) == ([], [A])
    # registered and fine: nothing to do; unhealthy or no longer wanted: deleted
    reg = [{"id": "1", "url": A["url"], "model_id": "ma"}, {"id": "2", "url": B["url"], "model_id": "mb"}]
    assert rk.changes([A, B], {A["url"]: True, B["url"]: True}, reg, {}) == ([], [])
    assert rk.changes([A, B], {A["url"]: True, B["url"]: False}, reg, {}) == (["2"], [])
    assert rk.changes([A], {A["url"]: True}, reg, {}) == (["2"], [])
    # a stranger (registered by hand) goes too
    assert rk.changes([], {}, [{"id": "9", "url": "http://x:1", "model_id": "x"}], {}) == (["9"], [])
    # another model name, or a key changed since this keeper posted it: deleted now, posted next round
    moved = [{"id": "1", "url": A["url"], "model_id": "old"}]
    assert rk.changes([A], {A["url"]: True}, moved, {}) == (["1"], [])
    rekeyed = {A["url"]: rk.fingerprint({**A, "api_key": "old"})}
    assert rk.changes([A], {A["url"]: True}, reg[:1], rekeyed) == (["1"], [])
    assert rk.changes([A], {A["url"]: True}, reg[:1], {A["url"]: rk.fingerprint(A)}) == ([], [])


def test_settled_means_the_registry_matches_the_files():
    want = [A, B]
    doc = {"digest": rk.want_digest(want), "strangers": [],
           "deployments": [{"registered": True, "healthy": True}, {"registered": False, "healthy": False}]}
    assert rk.settled(doc, want)
    assert not rk.settled(doc, [A])                                     # the files changed since
    assert not rk.settled({**doc, "strangers": ["http://x:1"]}, want)
    assert not rk.settled({**doc, "deployments": [{"registered": False, "healthy": True}]}, want)


def test_the_released_router_parses_its_argv(tmp_path):
    """sglang-router's own parse_router_args (sglang_router/launch_router.py), in the router image."""
    from tests.router_image import build_locally
    image = build_locally(tmp_path)[-1]
    cfg = {"listen": "10.1.2.3", "port": 30001, "metrics_port": 29001, "backend_port": 30002, "interval_s": 1}
    argv = rk.router_argv(cfg, "sk-client-0123456789", "ADMINKEY0123")
    code = ("import json, sys; from sglang_router.launch_router import parse_router_args; "
            "a = parse_router_args(json.loads(sys.argv[1])); "
            "print(json.dumps({k: getattr(a, k) for k in ('host', 'port', 'enable_igw', 'policy', 'api_key', "
            "'control_plane_api_keys', 'health_check_interval_secs', 'health_failure_threshold', "
            "'prometheus_host', 'prometheus_port', 'health_check_endpoint')}, default=str))")
    p = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", code, json.dumps(argv)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["host"] == "127.0.0.1" and got["port"] == 30002 and got["enable_igw"] is True   # behind the front
    assert got["policy"] == "round_robin" and got["api_key"] == "sk-client-0123456789"
    assert "ADMINKEY0123" in str(got["control_plane_api_keys"]) and got["health_check_interval_secs"] == 2
    assert got["prometheus_host"] == "10.1.2.3" and got["prometheus_port"] == 29001
    assert got["health_check_endpoint"] == "/health" and got["health_failure_threshold"] == 2
    # no client key: an open router (no --api-key at all)
    assert "--api-key" not in rk.router_argv(cfg, None, "ADMINKEY0123")


# -- the key check in front of the router (hostside/router_front.py; #59 item 5) -----------------------

def test_the_front_gates_every_v1_path_as_vllm_does():
    from orchestrator.hostside import router_front as rf
    for path in ("/v1/models", "/v1", "/v1/models?x=1", "/V1/models", "//v1/models", "/%76%31/models",
                 "/x/../v1/models", "/v1/../v1/models", "http://h:1/v1/models", "/v1/chat/completions"):
        assert rf.gated(path), path
    for path in ("/health", "/liveness", "/readiness", "/workers", "/v10", "/v1x/models", "/get_model_info",
                 "/metrics", "http://h:1/health"):
        assert not rf.gated(path), path
    key = "sk-router-0123456789"
    assert rf.authorized([("authorization", f"Bearer {key}")], key)
    assert rf.authorized([("authorization", f"bearer  {key} ")], key)
    for headers in ([], [("authorization", "Bearer sk-wrong")], [("authorization", key)],
                    [("authorization", f"Basic {key}")], [("authorization", f"Bearer {key}")] * 2):
        assert not rf.authorized(headers, key), headers
    assert rf.body_framing([("content-length", "12")]) == ("length", 12)
    assert rf.body_framing([("transfer-encoding", "chunked")]) == ("chunked", 0)
    assert rf.body_framing([]) == ("none", 0)
    for bad in ([("content-length", "3"), ("transfer-encoding", "chunked")], [("transfer-encoding", "gzip, chunked")],
                [("content-length", "3"), ("content-length", "4")], [("content-length", "-1")]):
        with pytest.raises(rf.BadRequest):
            rf.body_framing(bad)
    with pytest.raises(rf.BadRequest):
        rf.parse_head(b"GET /v1/models\r\n\r\n")
    with pytest.raises(rf.BadRequest):
        rf.parse_head(b"GET /v1/models HTTP/1.1\r\n folded: x\r\n\r\n")


class _Backend:
    """A stand-in for the router behind the front: HTTP/1.1 with keep-alive; GET answers its path,
    POST echoes its body, /stream sends three chunks 0.3 s apart."""

    def __init__(self):
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True               # as the router behind deployctl's front

            def log_message(self, *a):
                pass

            def _send(self, body: bytes, code: int = 200):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(3):
                        data = f"data: {i}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                        time.sleep(0.3)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self._send(json.dumps({"path": self.path, "auth": self.headers.get("Authorization")}).encode())

            def do_POST(self):
                if self.headers.get("Transfer-Encoding") == "chunked":
                    body = b""
                    while True:
                        n = int(self.rfile.readline().strip(), 16)
                        if not n:
                            self.rfile.readline()
                            break
                        body += self.rfile.read(n)
                        self.rfile.readline()
                else:
                    body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]


def _front(key: str):
    import threading
    from orchestrator.hostside import router_front as rf
    backend = _Backend()
    got = {}
    ready = threading.Event()
    threading.Thread(target=rf.serve_forever, args=("127.0.0.1", 0, ("127.0.0.1", backend.port), key),
                     kwargs={"ready": lambda s: (got.update(port=s.sockets[0].getsockname()[1]), ready.set())},
                     daemon=True).start()
    assert ready.wait(10)
    return got["port"], backend


def _exchange(port: int, raw: bytes, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            data = s.recv(65536)
            if not data:
                return out
            out += data


def test_the_front_refuses_v1_models_without_the_key_and_relays_the_rest():
    """The clients' key on /v1/models (no key, a wrong key: 401; the key: the router's own answer),
    /health open; bodies (length and chunked) and a streamed answer relayed as they come; on one kept-
    alive connection a refused request is answered after the earlier ones, then the connection closed."""
    from orchestrator.hostside import httpcall
    key = "sk-router-0123456789"
    port, backend = _front(key)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpcall.call(url + "/v1/models")[0] == 401
        assert httpcall.call(url + "/v1/models", "sk-wrong-000000")[0] == 401
        code, body = httpcall.call(url + "/v1/models", key)
        assert code == 200 and json.loads(body) == {"path": "/v1/models", "auth": f"Bearer {key}"}
        assert httpcall.call(url + "/health")[0] == 200
        assert httpcall.call(url + "/v1/chat/completions", None, {"model": "m"})[0] == 401
        code, body = httpcall.call(url + "/v1/chat/completions", key, {"model": "m", "x": "y" * 100_000})
        assert code == 200 and json.loads(body)["x"] == "y" * 100_000
        chunked = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                   "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        raw = _exchange(port, chunked.encode())
        assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"hello world"), raw
        # one connection: an admitted request, then /v1/models without the key: 200, then 401, closed
        two = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
               "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n").encode()
        raw = _exchange(port, two)
        assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1 ") == 2, raw
        assert raw.split(b"HTTP/1.1 ")[2].startswith(b"401 Unauthorized"), raw
        # a streamed answer comes chunk by chunk, not at its end
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"GET /stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
            t0, first = time.monotonic(), b""
            while b"data: 0" not in first:
                first += s.recv(65536)
            assert time.monotonic() - t0 < 0.25 and b"data: 1" not in first, first     # the stream takes 0.9 s
    finally:
        backend.server.shutdown()


def test_a_keyed_router_listens_behind_the_front(tmp_path):
    cfg = {"listen": "10.1.2.3", "port": 30001, "metrics_port": 29001, "backend_port": 30002, "interval_s": 1}
    argv = rk.router_argv(cfg, "sk-client-0123456789", "ADMINKEY0123")
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "30002"
    assert argv[argv.index("--prometheus-host") + 1] == "10.1.2.3"        # metrics stay where they were
    argv = rk.router_argv(cfg, None, "ADMINKEY0123")                        # an open router: no front
    assert argv[argv.index("--host") + 1] == "10.1.2.3" and argv[argv.index("--port") + 1] == "30001"
    assert rk._router_url(cfg, True) == "http://127.0.0.1:30002" and rk._router_url(cfg) == "http://10.1.2.3:30001"
    (tmp_path / "r.key").write_text("sk-router-0123456789\n")
    r = load_inventory(InventoryRef.of(_inv(tmp_path, {"host": "n3", "port": 9000, "api_key_file": "r.key"}), "big")).router
    assert r.backend == 9001 and layout.config(r)["backend_port"] == 9001
    with pytest.raises(InputError) as e:
        load_inventory(InventoryRef.of(_inv(tmp_path, {"port": 9000, "backend_port": 9000}), "big"))
    assert e.value.key == "all.vars.router.backend_port"
    with pytest.raises(InputError) as e:
        load_deployment(InventoryRef.of(_inv(tmp_path, {"host": "n3", "port": 8000}), "small"))
    assert "port 8001 is the API of deployment small and the router's backend" in str(e.value)
