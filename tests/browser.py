"""A real headless Chromium (Debian's `chromium`) driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: requests on fd 3, answers and events on fd 4, each a JSON message ended by
NUL; the transport Puppeteer's `pipe: true` uses), standard library only. Tests and benches load
pages with it and read what the page rendered (Runtime.evaluate), and take screenshots.

This machine has no internet: the flags keep Chromium from reaching out (no component updates, no
background networking, no sync, no QUIC) and every browser gets a fresh profile folder.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--disable-dev-shm-usage", "--remote-debugging-pipe")


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _above_4(fd: int) -> int:
    """FD moved to a number above 4, so that putting the pipe on 3 and 4 never overwrites the other end."""
    import fcntl
    if fd > 4:
        return fd
    n = fcntl.fcntl(fd, fcntl.F_DUPFD, 5)
    os.close(fd)
    return n


class BrowserError(RuntimeError):
    pass


class Browser:
    """One Chromium process; `page(url)` opens a tab. close() ends it (and removes its profile)."""

    def __init__(self, width: int = 1280, height: int = 1000):
        exe = executable()
        if exe is None:
            raise BrowserError("no chromium on this machine (apt-get install chromium; .ci/setup installs it)")
        self.profile = tempfile.mkdtemp(prefix="dctl-chromium-")
        r_ours, w_theirs = os.pipe()          # we read what Chromium writes on its fd 4
        r_theirs, w_ours = os.pipe()          # Chromium reads our requests on its fd 3
        r_theirs, w_theirs = _above_4(r_theirs), _above_4(w_theirs)
        # the shell puts the pipe's ends on fds 3 and 4, where Chromium looks for them, and execs it
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{r_theirs} 4>&{w_theirs} {r_theirs}<&- {w_theirs}>&-', "bash",
             exe, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(r_theirs, w_theirs))
        os.close(r_theirs)
        os.close(w_theirs)
        self.rfile, self.wfile = os.fdopen(r_ours, "rb", buffering=0), os.fdopen(w_ours, "wb", buffering=0)
        self.next_id, self.lock = 0, threading.Lock()
        self.answers: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._reader, daemon=True).start()
        self.width, self.height = width, height

    def _reader(self) -> None:
        buf = b""
        while True:
            chunk = self.rfile.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                doc = json.loads(msg)
                if "id" in doc:
                    with self.cond:
                        self.answers[doc["id"]] = doc
                        self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict[str, Any]:
        with self.lock:
            self.next_id += 1
            n = self.next_id
            msg = {"id": n, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
            self.wfile.write(json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        with self.cond:
            while n not in self.answers:
                if self.closed:
                    raise BrowserError(f"chromium exited (rc {self.proc.poll()}) before answering {method}")
                left = end - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"no answer to {method} within {timeout:g}s")
                self.cond.wait(left)
            doc = self.answers.pop(n)
        if "error" in doc:
            raise BrowserError(f"{method}: {doc['error']}")
        return doc.get("result") or {}

    def page(self, url: str = "about:blank") -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        p = Page(self, target, session)
        p.send("Page.enable")
        p.send("Runtime.enable")
        p.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                      "deviceScaleFactor": 1, "mobile": False})
        if url != "about:blank":
            p.goto(url)
        return p

    def pids(self) -> list[int]:
        """Chromium's processes (the browser and its children), for CPU and memory figures."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                todo += [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                pass
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for f in (self.rfile, self.wfile):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, target: str, session: str):
        self.browser, self.target, self.session = browser, target, session

    def send(self, method: str, params: dict | None = None, timeout: float = 30) -> dict[str, Any]:
        return self.browser.send(method, params, self.session, timeout)

    def goto(self, url: str, timeout: float = 30) -> None:
        """Navigate and wait until the document has loaded (readyState complete)."""
        self.send("Page.navigate", {"url": url}, timeout)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def eval(self, expression: str, timeout: float = 30) -> Any:
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                      timeout)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]}: {r['exceptionDetails'].get('text')} "
                               f"{(r['exceptionDetails'].get('exception') or {}).get('description', '')}")
        return (r.get("result") or {}).get("value")

    def wait(self, expression: str, timeout: float = 30, every: float = 0.1) -> Any:
        """Until EXPRESSION is truthy in the page; returns its value."""
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            try:
                last = self.eval(expression)
            except BrowserError as e:
                last = str(e)
            else:
                if last:
                    return last
            time.sleep(every)
        raise AssertionError(f"not within {timeout:g}s: {expression} (last: {last!r}); page text: "
                             f"{(self.text() or '')[:3000]}")

    def text(self) -> str:
        try:
            return self.eval("document.body ? document.body.innerText : ''") or ""
        except BrowserError as e:
            return f"(no text: {e})"

    def screenshot(self, path: str | Path, full: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full}
        if full:
            h = self.eval("Math.max(document.documentElement.scrollHeight, document.body ? document.body.scrollHeight : 0)")
            params["clip"] = {"x": 0, "y": 0, "width": self.browser.width, "height": max(int(h or 0), 100), "scale": 1}
        data = self.send("Page.captureScreenshot", params)["data"]
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(base64.b64decode(data))
        return p

    def cookies(self) -> list[dict[str, Any]]:
        return self.send("Network.getCookies").get("cookies", []) if self.send("Network.enable") is not None else []

    def close(self) -> None:
        try:
            self.browser.send("Target.closeTarget", {"targetId": self.target}, timeout=10)
        except BrowserError:
            pass
