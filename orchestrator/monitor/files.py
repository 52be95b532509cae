"""The files of a deployment's Prometheus folder (pure): {path under the folder: text}."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from . import alerts, promconfig, thresholds
from .promconfig import RULES_DIR, TARGETS_DIR
from .write import CONFIG, dump

if TYPE_CHECKING:
    from ..deployment import Deployment


def files(dep: "Deployment", *, release: int | None, fabric_doc: dict[str, Any] | None, supervised: bool,
          scrape_interval: str, evaluation_interval: str,
          node_port: int = promconfig.NODE_EXPORTER_PORT) -> dict[str, str]:
    out = {CONFIG: dump(promconfig.document(scrape_interval, evaluation_interval)),
           f"{RULES_DIR}/deployctl-alerts.yml": dump(alerts.document()),
           f"{RULES_DIR}/thresholds-{dep.name}.yml": dump(thresholds.document(dep, fabric_doc))}
    groups = promconfig.targets(dep, release, node_port, supervised)
    for job in promconfig.JOBS:
        # a job this deployment has none of (no supervisor) gets an empty list: no stale target stays
        out[f"{TARGETS_DIR}/{job}-{dep.name}.json"] = json.dumps(groups.get(job, []), indent=1) + "\n"
    return out
