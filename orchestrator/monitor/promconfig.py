"""The Prometheus configuration deployctl writes (pure): prometheus.yml, whose jobs read their targets
from file_sd files (targets/<job>-<deployment>.json, re-read by Prometheus when they change, so a new
release label or another deployment needs no reload), and each deployment's target groups.

Jobs and what they scrape:
- deployctl-engine: the head's API port, /metrics. Neither released engine guards /metrics with the
  serving key: vLLM's AuthenticationMiddleware checks only paths under GUARDED_PREFIX ("/v1", "/v2",
  "/inference", "/cohere"; vllm/entrypoints/serve/middleware/authenticate.py) and SGLang's
  decide_request_auth always admits /health*, /metrics* (sglang/srt/utils/auth.py): no credentials
  are configured, so the key never reaches a Prometheus host (tests/conformance/test_api_key.py
  test_prometheus_scrapes_the_engine_without_the_key asks both released engines).
- deployctl-supervisor: the head's supervisor, supervise.port, /metrics (hostside/supervisor.py).
- node: the standard prometheus-node-exporter on every host (its default port 9100).
- deployctl-router: the inventory's router (all.vars.router), its own Prometheus port (metrics_port;
  sglang-router's --prometheus-host/--prometheus-port, sglang_router/router_args.py): smg_router_*
  series per model. Labelled router (its host) only: every deployment's file lists the same target
  with the same labels, which Prometheus scrapes once.
Every target is labelled deployment, host, rank, and release (the head's release history when the
config was written: write it again after an `up` to keep it current), the engine's also model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..deployment import Deployment

JOBS = ("deployctl-engine", "deployctl-supervisor", "node", "deployctl-router")
NODE_EXPORTER_PORT = 9100
RULES_DIR, TARGETS_DIR = "rules", "targets"


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def targets(dep: "Deployment", release: int | None, node_port: int = NODE_EXPORTER_PORT,
            supervised: bool = True) -> dict[str, list[dict[str, Any]]]:
    """{job: file_sd target groups} for DEP."""
    c, e = dep.cluster, dep.recipe.engine
    head = c.head_host
    rel = {"release": str(release)} if release is not None else {}

    def labels(h) -> dict[str, str]:
        return {"deployment": dep.name, "host": h.name, "rank": str(h.rank), **rel}
    api = dep.api_url.split("://", 1)[-1].rstrip("/")
    out: dict[str, list[dict[str, Any]]] = {
        "deployctl-engine": [{"targets": [api], "labels": {**labels(head), "model": e.served_name,
                                                           "engine": e.kind}}],
        "node": [{"targets": [_hostport(h.address, node_port)], "labels": labels(h)} for h in c.hosts],
    }
    if c.router is not None:
        r = c.router
        out["deployctl-router"] = [{"targets": [_hostport(r.address if r.address not in ("0.0.0.0", "::")
                                                          else r.host.address, r.metrics_port)],
                                    "labels": {"router": r.host.name}}]
    if supervised:
        out["deployctl-supervisor"] = [{"targets": [_hostport(head.address, dep.recipe.supervise.port)],
                                        "labels": labels(head)}]
    return out


def document(scrape_interval: str, evaluation_interval: str) -> dict[str, Any]:
    """prometheus.yml: every deployment's targets and rules by glob, so one file serves them all."""
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
        "rule_files": [f"{RULES_DIR}/*.yml"],
        "scrape_configs": [_job(job) for job in JOBS],
    }


def _job(job: str) -> dict[str, Any]:
    j: dict[str, Any] = {"job_name": job, "metrics_path": "/metrics"}
    if job == "deployctl-supervisor":
        # its samples name the host and rank they are about (every rank's memory and disk), not the
        # head it is scraped from: its labels win over the target's
        j["honor_labels"] = True
    j["file_sd_configs"] = [{"files": [f"{TARGETS_DIR}/{job}-*.json"]}]
    return j


def merge(existing: dict[str, Any], ours: dict[str, Any], folder: str) -> dict[str, Any]:
    """An operator's prometheus.yml with deployctl's jobs and rule files added (jobs of the same name
    replaced, everything else kept); paths made absolute under FOLDER."""
    out = dict(existing or {})
    mine = {j["job_name"] for j in ours["scrape_configs"]}
    jobs = [j for j in out.get("scrape_configs") or [] if j.get("job_name") not in mine]
    for j in ours["scrape_configs"]:
        j = dict(j, file_sd_configs=[{"files": [f"{folder}/{f}" for f in sd["files"]]} for sd in j["file_sd_configs"]])
        jobs.append(j)
    out["scrape_configs"] = jobs
    rules = [r for r in out.get("rule_files") or [] if not str(r).startswith(f"{folder}/")]
    out["rule_files"] = rules + [f"{folder}/{r}" for r in ours["rule_files"]]
    return out
