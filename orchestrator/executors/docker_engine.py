"""deployctl's Docker executor: Docker SDK clients for a host's engine (over SSH) or the local one,
and the few engine operations the stages share (build from a context tar, run a container with
streamed output, copy files out, check paths inside an image).

    client = client_for(host, known_hosts_file=cluster.known_hosts_file,
                        host_key_checking=cluster.host_key_checking)      # ssh://user@host:port
    client = local_client()                                              # DOCKER_HOST or the local socket
    client = engine_client(cluster, host, local=False)                   # either, from the inventory

How `ssh://` engines are reached, and why not docker-py's own SSH transport
---------------------------------------------------------------------------
docker-py 7 has two SSH modes and neither fits the inventory's rules:
- the paramiko mode (`DockerClient(base_url="ssh://...")`) loads only ~/.ssh/known_hosts
  (`load_system_host_keys()` without a path), takes the key file only from ~/.ssh/config
  (`IdentityFile`), has no connect/banner/auth timeout, and cannot be given the inventory's
  known_hosts_file, key file or host_key_checking;
- the shell-out mode (`use_ssh_client=True`) runs the `ssh` binary with the user's ~/.ssh/config and
  no way to pass `-F`/`-i`/`-o UserKnownHostsFile` (short of rewriting HOME for the whole process).
So we open the SSH connection ourselves with deployctl's SSH executor (`executors/ssh.py`: the
inventory's key file only, the inventory's known_hosts file, paramiko's reject policy for an unknown
key unless `host_key_checking: false`, timeouts on connect, banner, auth and channel open, keepalives)
and hand its transport to docker-py's HTTP-over-SSH connection classes: every HTTP connection is a new
channel on that transport running `docker -H <docker_host> system dial-stdio` on the host, exactly
what docker-py and the docker CLI do. ~/.ssh/config is never read. `-H` is the inventory's
docker_host for that host (default the standard socket), so a host whose engine listens elsewhere
works too.

Timeouts: `timeout` is the longest silence on an API call (docker-py's read timeout); builds and
container runs take their own (a compile can be silent for minutes) and also stop at a deadline.
"""
from __future__ import annotations

import base64
import io
import json
import tarfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterable, Iterator, Sequence

import docker
import docker.errors
import requests.exceptions
from docker.transport.sshconn import SSHConnection, SSHConnectionPool, SSHHTTPAdapter

from ..errors import DeployctlError
from .docker_cli import docker_sh

if TYPE_CHECKING:
    from ..inventory import Cluster, Host
    from .ssh import SSHSession

DEFAULT_TIMEOUT = 120.0           # longest silence on one API call
MIN_API_VERSION = "1.24"          # only used until the engine tells us its own
TAIL_LINES = 30

LineFn = Callable[[str], None]


class EngineError(DeployctlError):
    """A Docker engine could not be reached or refused an operation; names the engine."""

    def __init__(self, where: str, message: str, tail: list[str] | None = None):
        self.where, self.tail = where, tail or []
        super().__init__(f"{where}: {message}")


class BuildError(EngineError):
    """`docker build` failed; `tail` holds the last lines of its output."""


# ------------------------------------------------------------------------------------------------
# Clients

class _DialStdioConnection(SSHConnection):
    """One HTTP connection = one SSH channel running `docker ... system dial-stdio` on the host."""

    def __init__(self, transport, timeout, command: str, open_timeout: float):
        super().__init__(ssh_transport=transport, timeout=timeout)
        self._command, self._open_timeout = command, open_timeout

    def connect(self):
        ch = self.ssh_transport.open_session(timeout=self._open_timeout)
        ch.settimeout(self.timeout)
        ch.exec_command(self._command)
        self.sock = ch


class _DialStdioPool(SSHConnectionPool):
    def __init__(self, adapter: "_TunnelAdapter", timeout, maxsize: int):
        super().__init__(ssh_client=None, timeout=timeout, maxsize=maxsize, host=None)
        self._adapter = adapter

    def _new_conn(self):
        a = self._adapter
        return _DialStdioConnection(a.transport(), self.timeout, a.command, a.open_timeout)


class _TunnelAdapter(SSHHTTPAdapter):
    """docker-py's SSH adapter, fed by a paramiko session that deployctl opened and checked."""

    def __init__(self, open_session: Callable[[], "SSHSession"], command: str, timeout: float,
                 open_timeout: float, max_pool_size: int = 10):
        # shell_out=True: the parent makes no SSH connection of its own (we bring ours).
        super().__init__("ssh://deployctl", timeout=timeout, max_pool_size=max_pool_size, shell_out=True)
        self._open_session, self.command, self.open_timeout = open_session, command, open_timeout
        self._session = open_session()
        self._lock = threading.Lock()

    def transport(self):
        with self._lock:
            t = self._session.transport
            if not t.is_active():           # the link dropped (keepalive noticed): connect again
                self._session.close()
                self._session = self._open_session()
                t = self._session.transport
            return t

    def get_connection(self, url, proxies=None):
        # One pool for the adapter's one engine. requests hands over the whole request URL here,
        # so pools keyed by it (as docker-py's adapter does) would dial a new channel for each path.
        with self.pools.lock:
            pool = self.pools.get("engine")
            if pool is None:
                pool = _DialStdioPool(self, self.timeout, self.max_pool_size)
                self.pools["engine"] = pool
            return pool

    def close(self):
        super().close()
        self._session.close()


class _TunnelAPIClient(docker.APIClient):
    def __init__(self, adapter: _TunnelAdapter, base_url: str, timeout: float):
        # use_ssh_client=True only so that the parent starts no SSH connection; the adapter is replaced.
        super().__init__(base_url=base_url, version=MIN_API_VERSION, timeout=timeout, use_ssh_client=True)
        self._custom_adapter = adapter
        self.mount("http+docker://ssh", adapter)
        # docker-py's "auto" version detection would run before our adapter is mounted: do it now.
        self._version = self._retrieve_server_version()


class _Client(docker.DockerClient):
    def __init__(self, api: docker.APIClient):      # noqa: D107 - DockerClient around a given APIClient
        self.api = api


def client_for(host: "Host", *, known_hosts_file: str | None = None, host_key_checking: bool = True,
               timeout: float = DEFAULT_TIMEOUT, connect_timeout: float = 10.0) -> docker.DockerClient:
    """A Docker SDK client for HOST's engine over SSH (see the module notes for host keys)."""
    from .ssh import SSHError, SSHTarget

    target = SSHTarget(host=host.name, address=host.address, port=host.port, user=host.user,
                       key_file=host.key_file, known_hosts_file=known_hosts_file,
                       check_host_keys=host_key_checking, connect_timeout=connect_timeout)
    command = docker_sh(host, "system", "dial-stdio")      # the one -H rule (docker_cli.py)
    adapter = _TunnelAdapter(target.connect, command, timeout, connect_timeout)   # SSHError: names the host
    try:
        api = _TunnelAPIClient(adapter, host.ssh_url, timeout)
    except (docker.errors.DockerException, requests.exceptions.RequestException, SSHError, OSError) as e:
        adapter.close()
        raise EngineError(f"{host.name} ({host.ssh_url})",
                          f"no Docker engine answers through `{command}`: {e}. Is docker installed on the "
                          f"host and is {host.docker_host} its engine socket (inventory docker_host)?") from None
    return _Client(api)


def local_client(timeout: float = DEFAULT_TIMEOUT) -> docker.DockerClient:
    """The engine of this machine (DOCKER_HOST, else the standard socket), checked with a ping."""
    try:
        client = docker.from_env(timeout=int(timeout))
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        raise EngineError("local engine", f"cannot reach the Docker engine of this machine: {e}") from None
    return client


def engine_client(cluster: "Cluster", host: "Host", *, local: bool = False,
                  timeout: float = DEFAULT_TIMEOUT) -> docker.DockerClient:
    """HOST's engine as the inventory describes it, or this machine's engine when `local`."""
    if local:
        return local_client(timeout)
    return client_for(host, known_hosts_file=cluster.known_hosts_file,
                      host_key_checking=cluster.host_key_checking, timeout=timeout)


def engine_name(client: docker.DockerClient) -> str:
    """A short description of the engine a client talks to (for messages and reports)."""
    try:
        info = client.info()
        return f"{info.get('Name', '?')} (docker {info.get('ServerVersion', '?')}, {info.get('Architecture', '?')})"
    except (docker.errors.DockerException, requests.exceptions.RequestException):
        return "?"


# ------------------------------------------------------------------------------------------------
# Images

def image_id(client: docker.DockerClient, ref: str) -> str | None:
    """The ID of image REF in this engine, or None when it is not there."""
    try:
        return client.api.inspect_image(ref)["Id"]
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as e:
        if e.status_code == 404:
            return None
        raise


def build_image(client: docker.DockerClient, context: BinaryIO, *, where: str,
                dockerfile: str = "Dockerfile", buildargs: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                on_line: LineFn = lambda line: None, timeout: float = 3600.0,
                nocache: bool = False, cancel: threading.Event | None = None, platform: str | None = None) -> str:
    """`docker build` of an uncompressed context tar (DOCKERFILE at its root); returns the image ID.

    PLATFORM (linux/arm64, linux/amd64): `docker build --platform`, what the image is built for (the
    build API's `platform`, API 1.32+); None: the engine's own.

    Output lines go to ON_LINE as they come. `timeout` bounds the whole build and each silence.
    A failure raises BuildError with the engine's message and the output tail; nothing is pulled.
    """
    tail: list[str] = []
    deadline = time.monotonic() + timeout

    def emit(line: str) -> None:
        tail.append(line)
        del tail[:-TAIL_LINES]
        on_line(line)

    partial = ""
    result: str | None = None
    stream = client.api.build(fileobj=context, custom_context=True, dockerfile=dockerfile, rm=True,
                              forcerm=True, pull=False,
                              buildargs=buildargs or {}, labels=labels or {}, nocache=nocache,
                              decode=True, timeout=timeout, platform=platform)
    try:
        for item in stream:
            if cancel is not None and cancel.is_set():
                raise BuildError(where, "build cancelled", tail)
            if time.monotonic() > deadline:
                raise BuildError(where, f"build did not finish within {timeout:g}s", tail)
            if "stream" in item:
                text = partial + item["stream"]
                *lines, partial = text.split("\n")
                for line in lines:
                    emit(line.rstrip("\r"))
            elif "status" in item:
                emit(str(item["status"]))
            if "error" in item:
                if partial:
                    emit(partial)
                detail = item.get("errorDetail") or {}
                msg = str(item["error"]).strip()
                code = detail.get("code")
                raise BuildError(where, f"docker build failed: {msg}" + (f" (code {code})" if code else ""), tail)
            aux = item.get("aux")
            if isinstance(aux, dict) and aux.get("ID"):
                result = aux["ID"]
    except (requests.exceptions.RequestException, docker.errors.DockerException) as e:
        raise BuildError(where, f"docker build interrupted: {e}", tail) from None
    finally:
        close = getattr(stream, "close", None)
        if close:
            close()
    if partial:
        emit(partial)
    if result is None:
        for line in reversed(tail):        # older engines: "Successfully built <short id>"
            if line.startswith("Successfully built "):
                result = client.api.inspect_image(line.split()[-1])["Id"]
                break
    if result is None:
        raise BuildError(where, "docker build ended without an image ID", tail)
    return result


def repository(ref: str) -> str:
    """REF without its tag or digest: registry:5000/org/name:tag -> registry:5000/org/name."""
    return docker.utils.parse_repository_tag(ref.split("@", 1)[0])[0]


def tag_image(client: docker.DockerClient, image: str, ref: str) -> None:
    repo, tag = docker.utils.parse_repository_tag(ref)
    if not client.api.tag(image, repo, tag or "latest", force=True):
        raise EngineError("engine", f"could not tag {image} as {ref}")


def remove_image(client: docker.DockerClient, ref: str) -> str | None:
    """Remove (or untag) REF; returns why not when the engine refuses (e.g. it has child images)."""
    try:
        client.api.remove_image(ref, noprune=False)
        return None
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as e:
        return str(e.explanation or e)


# ------------------------------------------------------------------------------------------------
# Containers

@dataclass
class RunResult:
    rc: int
    tail: list[str] = field(default_factory=list)
    output: str = ""                  # the whole output, up to `keep_bytes`


def run_container(client: docker.DockerClient, image: str, argv: Sequence[str], *, where: str,
                  workdir: str | None = None, env: dict[str, str] | None = None, gpus: bool = False,
                  upload: tuple[str, BinaryIO] | None = None, download: str | None = None,
                  download_to: BinaryIO | None = None, on_line: LineFn = lambda line: None,
                  timeout: float = 600.0, cancel: threading.Event | None = None,
                  labels: dict[str, str] | None = None, keep_bytes: int = 1 << 20) -> RunResult:
    """Run ARGV in a new container of IMAGE (its entrypoint replaced by argv[0]) and remove it after.

    `upload` = (dir, tar stream) is unpacked into the container before it starts; `download` = a
    path copied out (as a tar stream into `download_to`) after it exits 0. Output is streamed to
    ON_LINE. A deadline or CANCEL kills the container; it is removed in every case (Ctrl-C too).
    """
    device_requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpus else None
    try:
        container = client.containers.create(
            image, command=list(argv[1:]), entrypoint=[argv[0]], working_dir=workdir,
            environment=env or {}, device_requests=device_requests, labels=labels or {},
            network_disabled=False, detach=True)
    except docker.errors.DockerException as e:
        raise EngineError(where, f"cannot create a container of {image}: {e}") from None
    stop = threading.Event()
    why: list[str] = []

    def watchdog() -> None:
        deadline = time.monotonic() + timeout
        while not stop.wait(0.2):
            if cancel is not None and cancel.is_set():
                why.append("cancelled")
            elif time.monotonic() > deadline:
                why.append(f"did not finish within {timeout:g}s")
            else:
                continue
            try:
                container.kill()
            except docker.errors.DockerException:
                pass
            return

    tail: list[str] = []
    kept = io.StringIO()
    try:
        if upload is not None:
            dest, data = upload
            if not container.put_archive(dest, data):
                raise EngineError(where, f"cannot copy files into the container at {dest}")
        container.start()
        dog = threading.Thread(target=watchdog, daemon=True)
        dog.start()
        for line in _lines(container.logs(stream=True, follow=True)):
            tail.append(line)
            del tail[:-TAIL_LINES]
            if kept.tell() < keep_bytes:
                kept.write(line + "\n")
            on_line(line)
        rc = int(container.wait(timeout=max(timeout, 1.0)).get("StatusCode", -1))
        stop.set()
        if why:
            raise EngineError(where, f"`{' '.join(argv)}` {why[0]}", tail)
        if rc == 0 and download is not None and download_to is not None:
            bits, _stat = container.get_archive(download)
            for chunk in bits:
                download_to.write(chunk)
        return RunResult(rc, tail, kept.getvalue())
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        raise EngineError(where, f"container of {image} failed: {e}", tail) from None
    finally:
        stop.set()
        try:
            container.remove(force=True)
        except docker.errors.DockerException:
            pass


def _lines(chunks: Iterable[bytes]) -> Iterator[str]:
    buf = b""
    for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode(errors="replace").rstrip("\r")
    if buf:
        yield buf.decode(errors="replace").rstrip("\r")


def stat_paths(client: docker.DockerClient, image: str, paths: Sequence[str], *, where: str) -> dict[str, str]:
    """For each absolute PATH: 'file', 'dir', 'other' or 'missing' inside IMAGE.

    Reads the image's filesystem through a created (never started) container: nothing runs, so it
    works for any image (no shell needed, the entrypoint is irrelevant).
    """
    out: dict[str, str] = {}
    try:
        container = client.containers.create(image, command=["true"], entrypoint=["true"])
    except docker.errors.DockerException as e:
        raise EngineError(where, f"cannot create a container of {image} to inspect it: {e}") from None
    try:
        url = client.api._url("/containers/{0}/archive", container.id)
        for p in paths:
            # HEAD /containers/{id}/archive: the path's stat only (GET would stream a folder's whole tar)
            res = client.api.head(url, params={"path": p})
            if res.status_code == 404:
                out[p] = "missing"
                continue
            res.raise_for_status()
            stat = json.loads(base64.b64decode(res.headers.get("X-Docker-Container-Path-Stat", "e30=")))
            mode = int(stat.get("mode", 0))
            # Go's os.FileMode: dir 1<<31, symlink 1<<27, device/pipe/socket/char 1<<26,25,24,21
            if mode & (1 << 31):
                out[p] = "dir"
            elif mode & ((1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21)):
                out[p] = "other"
            else:
                out[p] = "file"
    except (docker.errors.DockerException, requests.exceptions.RequestException, ValueError) as e:
        raise EngineError(where, f"cannot inspect files of {image}: {e}") from None
    finally:
        try:
            container.remove(force=True)
        except docker.errors.DockerException:
            pass
    return out


def tar_members(stream: BinaryIO) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """All members of a (small) tar stream with their contents: for files copied out of a container."""
    out = []
    with tarfile.open(fileobj=stream, mode="r|*") as tf:
        for m in tf:
            data = tf.extractfile(m).read() if m.isfile() else None   # type: ignore[union-attr]
            out.append((m, data))
    return out


def registry_digest(client: docker.DockerClient, ref: str) -> str:
    """The registry's current digest of REF, as the engine sees it (raises EngineError when it cannot)."""
    try:
        return client.images.get_registry_data(ref).id
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        raise EngineError("engine", f"cannot query the registry for {ref}: {e}") from None


def repo_digests(client: docker.DockerClient, ref: str) -> list[str]:
    try:
        return list(client.api.inspect_image(ref).get("RepoDigests") or [])
    except docker.errors.ImageNotFound:
        return []


def pull(client: docker.DockerClient, ref: str, *, where: str, platform: str | None = None) -> str:
    """Pull REF (repo:tag or repo@sha256:...), for PLATFORM if given (linux/arm64), and return its image ID."""
    try:
        return client.images.pull(ref, platform=platform).id
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        raise EngineError(where, f"cannot pull {ref}: {e}") from None
