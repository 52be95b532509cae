"""The router's front door, in its container: the clients' key checked on every /v1/ path, /v1/models
included, before a byte reaches the router. Standard library only (it runs from the host-side zipapp in
the router image's python, in the launcher's process: hostside/router_keeper.py `launch`).

Why (docs/router.md, docs/exposure.md): sglang-router 0.3.2 checks its `--api-key` only on the routes
it builds as protected (its server.rs `build_app`: /v1/chat/completions, /v1/completions, /generate,
...); /v1/models, /health, /get_model_info and /get_server_info are its public routes, and no option of
the released package (sglang_router/router_args.py) moves one. vLLM, given a key, refuses every /v1/
path without it (vllm/entrypoints/openai/api_server.py, its authentication middleware). With a client
key the router listens on 127.0.0.1 only (config `backend_port`), and this front on the router's
address and port applies vLLM's rule: a request whose path is under /v1 without `Authorization: Bearer
<key>` gets 401 here; everything else (the key's holder, /health, the router's own admin routes with
their own key) goes to the router unchanged.

It is a relay, not an HTTP server: per client connection it reads each request's head (request line
and headers) and its body framing (Content-Length, or chunked), decides, and forwards the same bytes
on one connection to the router; the router's answers come back as they are sent (streamed chunks
included), byte for byte, TCP_NODELAY on both sides. An Upgrade or CONNECT request, once admitted, turns
the connection into a plain two-way copy. A request refused while earlier answers on the same
connection are still coming is answered after them, then the connection is closed.
"""
from __future__ import annotations

import asyncio
import hmac
import posixpath
import socket
import urllib.parse

MAX_HEAD = 64 * 1024                 # request line + headers
CHUNK = 64 * 1024
GATED = "/v1"                        # vLLM's rule: every path under /v1 needs the key


class BadRequest(Exception):
    """A request this relay cannot frame: answered 400 and the connection closed."""


def gated(target: str) -> bool:
    """Does TARGET (the request line's, origin or absolute form) name a path under /v1? Judged on the
    raw path and on its decoded, dot-segment-resolved form, case-insensitively: over-refusing a path
    the router would not serve costs a 401 instead of its 404, never a leak."""
    if target.startswith(("http://", "https://")):
        target = urllib.parse.urlsplit(target).path or "/"
    raw = target.split("?", 1)[0].split("#", 1)[0]
    clean = posixpath.normpath("/" + urllib.parse.unquote(raw).lstrip("/")).replace("//", "/")
    for p in (raw.lower(), clean.lower()):
        if p == GATED or p.startswith(GATED + "/"):
            return True
    return False


def authorized(headers: list[tuple[str, str]], key: str) -> bool:
    """Exactly one Authorization header, `Bearer <key>` (constant-time compare)."""
    vals = [v for k, v in headers if k == "authorization"]
    if len(vals) != 1:
        return False
    scheme, _, token = vals[0].strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(method, target, version, [(lower-case name, value)]) of a request head ending in CRLF CRLF."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:                       # pragma: no cover - latin-1 decodes any byte
        raise BadRequest("undecodable head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[2].startswith("HTTP/1."):
        raise BadRequest(f"bad request line {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"bad header line {line[:80]!r}")
        headers.append((name.lower(), value.strip()))
    return parts[0].upper(), parts[1], parts[2], headers


def body_framing(headers: list[tuple[str, str]]) -> tuple[str, int]:
    """("chunked", 0), ("length", N) or ("none", 0); a request framed two ways (or badly) is refused:
    the relay and the router must agree on where it ends (no request smuggling through the gate)."""
    te = [v.lower() for k, v in headers if k == "transfer-encoding"]
    cl = {v for k, v in headers if k == "content-length"}
    if te:
        if cl or [t.strip() for t in ",".join(te).split(",")] != ["chunked"]:
            raise BadRequest("Transfer-Encoding other than a lone chunked, or with Content-Length")
        return "chunked", 0
    if cl:
        if len(cl) != 1 or not next(iter(cl)).isdigit():
            raise BadRequest("bad Content-Length")
        return "length", int(next(iter(cl)))
    return "none", 0


def _response(code: int, reason: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


UNAUTHORIZED = _response(401, "Unauthorized", b'{"error": "Unauthorized"}')


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """The next request head (through CRLF CRLF); None at a clean end of the connection."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise BadRequest("the connection ended inside a request head") from None
    except asyncio.LimitOverrunError:
        raise BadRequest(f"request head over {MAX_HEAD} bytes") from None


async def _relay_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str, n: int) -> None:
    if kind == "length":
        while n:
            data = await reader.read(min(n, CHUNK))
            if not data:
                raise BadRequest("the connection ended inside a request body")
            writer.write(data)
            n -= len(data)
            await writer.drain()
    elif kind == "chunked":
        while True:
            line = await reader.readuntil(b"\r\n")
            writer.write(line)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadRequest("bad chunk size") from None
            if size == 0:
                while True:                          # trailers, then the empty line
                    t = await reader.readuntil(b"\r\n")
                    writer.write(t)
                    if t == b"\r\n":
                        break
                await writer.drain()
                return
            await _relay_body(reader, writer, "length", size + 2)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(CHUNK)
        if not data:
            return
        writer.write(data)
        await writer.drain()


class Front:
    """Listens on (HOST, PORT); admitted requests go to the router at BACKEND; KEY: the clients' key."""

    def __init__(self, host: str, port: int, backend: tuple[str, int], key: str):
        self.host, self.port, self.backend, self.key = host, port, backend, key

    async def start(self) -> asyncio.base_events.Server:
        return await asyncio.start_server(self.handle, self.host, self.port, limit=MAX_HEAD, backlog=1024,
                                          reuse_address=True)

    async def handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        _nodelay(cw)
        uw: asyncio.StreamWriter | None = None
        pump: asyncio.Task | None = None
        state = {"refusing": False}

        async def answers(ur: asyncio.StreamReader) -> None:
            try:
                await _copy(ur, cw)
            except (ConnectionError, OSError):
                pass
            if not state["refusing"]:                # the router ended the connection: so does the client's
                cw.close()

        try:
            while True:
                head = await _read_head(cr)
                if head is None:                     # the client has sent all it will: its answers still come
                    if uw is not None and pump is not None:
                        uw.write_eof()
                        await pump
                    return
                method, target, _version, headers = parse_head(head)
                kind, n = body_framing(headers)
                if gated(target) and not authorized(headers, self.key):
                    state["refusing"] = True
                    if uw is not None and pump is not None:
                        uw.write_eof()               # the answers to earlier requests first
                        await pump
                    cw.write(UNAUTHORIZED)
                    await cw.drain()
                    return
                if uw is None:
                    ur, uw = await asyncio.open_connection(*self.backend, limit=MAX_HEAD)
                    _nodelay(uw)
                    pump = asyncio.ensure_future(answers(ur))
                uw.write(head)
                await _relay_body(cr, uw, kind, n)
                await uw.drain()
                upgrade = method == "CONNECT" or any(k == "upgrade" for k, _ in headers)
                if upgrade:                          # admitted: from here on a plain two-way copy
                    await _copy(cr, uw)
                    return
                if pump is not None and pump.done():
                    return
        except BadRequest as e:
            if not state["refusing"] and uw is None:
                body = ('{"error": "Bad Request: %s"}' % str(e).replace('"', "'")).encode()
                cw.write(_response(400, "Bad Request", body))
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if uw is not None:
                uw.close()
            if pump is not None and not pump.done():
                if state["refusing"]:
                    await asyncio.gather(pump, return_exceptions=True)
                else:
                    pump.cancel()
            try:
                await cw.drain()
            except (ConnectionError, OSError):
                pass
            cw.close()


def serve_forever(host: str, port: int, backend: tuple[str, int], key: str,
                  ready: "callable | None" = None) -> None:
    """Run the front until the process ends (in a thread of the launcher: its own event loop)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server = loop.run_until_complete(Front(host, port, backend, key).start())
    if ready:
        ready(server)
    loop.run_forever()
