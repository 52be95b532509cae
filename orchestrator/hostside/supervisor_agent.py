"""A worker's agent (hostside/supervisor.py): reports its rank once a second to the head's supervisor and
carries out its numbered orders; it never acts alone."""

from __future__ import annotations

import json
import os
import threading
from typing import Any
from .supervisor_detect import _request
from .supervisor_engine import Engine
from .supervisor_host import Local, log, masker, read_file


REPORT_EVERY_S = 1.0
FAST_REPORT_S = 0.2     # while the head restarts the group: agents report (and take orders) this often


def agent(cfg: dict[str, Any], state_dir: str, engine: Engine, stopping: threading.Event) -> int:
    token = read_file(os.path.join(state_dir, "token"))
    mask = masker([token])
    local = Local(cfg, engine)
    done: dict[str, Any] | None = None
    last_id = None
    url = f"{cfg['head_url']}/v1/sync"
    log(f"agent of {cfg['deployment']} on {cfg['host']}: reporting to {cfg['head_url']}")
    every = REPORT_EVERY_S
    while not stopping.is_set():
        try:
            v = local.view(mask)
            report = {"host": cfg["host"], "container": v.container, "boot_id": v.boot_id, "mem_kib": v.mem_kib,
                      "disk_avail": v.disk_avail, "log_tail": v.log_tail, "previous": v.previous, "done": done}
            code, raw = _request(url, token, report, 10)
            if code == 200:
                answer = json.loads(raw)
                asked = float(answer.get("report_every_s") or REPORT_EVERY_S)
                every = min(max(asked, FAST_REPORT_S), REPORT_EVERY_S)      # never faster, never slower
                order = answer.get("order")
                if order and order.get("id") != last_id:
                    last_id = order["id"]
                    try:
                        log(local.do(order["verb"]))
                        done = {"id": order["id"], "error": ""}
                    except (OSError, ValueError) as e:
                        done = {"id": order["id"], "error": str(e)}
                        log(f"order {order['verb']} failed: {e}")
                    continue         # report the result at once
            else:
                log(f"the supervisor answered HTTP {code}")
        except Exception as e:  # noqa: BLE001 - the head may be down: keep reporting, never act alone
            log(f"report failed: {type(e).__name__}: {e}")
        stopping.wait(every)
    return 0
