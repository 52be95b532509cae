"""One HTTP request with an optional bearer key and JSON body (standard library only), for what runs
on the hosts: the supervisor's probes of its engine, the router keeper's of the engines and the router."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def call(url: str, key: str | None = None, body: dict | None = None, timeout: float = 5.0,
         method: str | None = None) -> tuple[int, bytes]:
    """(status, body) of the answer, an HTTP error's included; OSError when nothing answered.
    METHOD: POST with a body, else GET, unless given."""
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 method=method or ("POST" if body is not None else "GET"),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
