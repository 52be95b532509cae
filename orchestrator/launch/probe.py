"""What launch and status read from a host before acting (network facts from fabric.py's
FACTS_SCRIPT, the staged tables, the image, the deployment's containers: one SSH round trip), and
whether the staged Engram rows are this host's rank's rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..stages.base import HostFailure
from ..tables.geometry import rank_ranges
from .commands import read_argv
from .containers import Container, parse_list
from .fabric import FACTS_SCRIPT
from .remote import HostShell

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host

# File names the staging stages write (orchestrator/tables/engram_stage.py, ple_write.py); the
# script below runs on hosts with only python3, so it names them itself.
ENGRAM_LOCAL = "engram-local.json"

# argv[1] = Engram folder or "", argv[2] = PLE folder or "". Prints one JSON object.
STAGED_SCRIPT = r"""
import glob, json, os, sys
eng, ple = sys.argv[1], sys.argv[2]
out = {}
if eng:
    e = {"dir": eng, "local": None, "error": "",
         "manifest": os.path.exists(os.path.join(eng, "engram-manifest.json"))}
    try:
        with open(os.path.join(eng, "engram-local.json")) as f:
            e["local"] = json.load(f)
    except FileNotFoundError:
        e["error"] = "missing"
    except (OSError, ValueError) as x:
        e["error"] = "unreadable: %s" % x
    out["engram"] = e
if ple:
    out["ple"] = {"dir": ple,
                  "tables": [[os.path.basename(p), os.path.getsize(p)]
                             for p in sorted(glob.glob(os.path.join(ple, "ple_table_*.bin")))],
                  "manifest": os.path.exists(os.path.join(ple, "deployctl-ple-manifest.json"))}
print(json.dumps(out))
"""


@dataclass(frozen=True)
class HostRead:
    facts: dict[str, Any] | None        # network facts (multi-node launches only)
    staged: dict[str, Any]              # {"engram": {...}, "ple": {...}}: only what the recipe puts on NVMe
    image_id: str | None                # the recipe's image in the host's engine; None: absent
    containers: list[Container]         # the deployment's containers, any state


def read_host(dep: "Deployment", sh: HostShell, head_address: str = "", timeout: float = 60.0) -> HostRead:
    """Everything launch and status need from a host, in one SSH round trip (commands.read_argv).
    HEAD_ADDRESS: also gather the network facts, routing towards that address."""
    r, host = dep.recipe, sh.host
    eng = dep.engram_dir(host) if r.engram and r.engram.placement == "nvme" else ""
    ple = dep.ple_dir(host) if r.ple and r.ple.placement == "nvme" else ""
    res = sh.run(read_argv(host.docker_host, dep.name, r.engine.image, head_address, FACTS_SCRIPT,
                           STAGED_SCRIPT, eng, ple), timeout=timeout)
    parts: dict[str, list[str]] = {}
    cur = None
    for line in res.stdout.splitlines():
        if line.startswith("@@") and line[2:] in ("facts", "staged", "image", "containers"):
            cur = parts.setdefault(line[2:], [])
        elif cur is not None:
            cur.append(line)
    if "containers" not in parts:
        raise HostFailure(f"reading the host failed (exit {res.rc}): "
                          f"{(res.stderr.strip() or res.stdout.strip())[-300:]}", rc=res.rc)
    img = parts["image"]
    image_rc = img[-1] if img else "exit ?"
    if image_rc == "exit 0":
        image = img[0].strip()
    elif any("no such" in line.lower() for line in img):
        image = None
    else:
        raise HostFailure(f"`docker image inspect {r.engine.image}` failed ({image_rc}): "
                          + " ".join(img[:-1])[-300:])
    return HostRead(facts=_json(parts["facts"], "network facts") if head_address else None,
                    staged=_json(parts["staged"], "the staged tables"), image_id=image,
                    containers=parse_list(res.rc, "\n".join(parts["containers"]), res.stderr,
                                          host.docker_host))


def _json(lines: list[str], what: str) -> dict[str, Any]:
    text = "\n".join(lines).strip()
    try:
        doc = json.loads(text)
    except ValueError:
        raise HostFailure(f"reading {what} failed: {text[-300:]!r}") from None
    if not isinstance(doc, dict):
        raise HostFailure(f"reading {what} failed: {text[-300:]!r}")
    return doc


def expected_engram(dep: "Deployment", rank: int) -> dict[str, list[int]]:
    """engram-local.json's "layers" for node RANK: the rows its GPU ranks own, per layer."""
    r = dep.recipe
    assert r.engram is not None
    tp, per = r.parallelism.tensor_parallel, r.parallelism.gpus_per_node
    out: dict[str, list[int]] = {}
    for gpu_rank in range(rank * per, (rank + 1) * per):
        for rr in rank_ranges(r.engram.geometry, tp, gpu_rank):
            lo, hi = out.get(str(rr.layer), [rr.row_start, rr.row_end])
            out[str(rr.layer)] = [min(lo, rr.row_start), max(hi, rr.row_end)]
    return out


def _layers(doc: Any) -> dict[str, list[int]] | None:
    layers = doc.get("layers", doc) if isinstance(doc, dict) else None
    if not isinstance(layers, dict):
        return None
    try:
        return {str(k): [int(v[0]), int(v[1])] for k, v in layers.items()}
    except (TypeError, ValueError, IndexError, KeyError):
        return None


def engram_problem(dep: "Deployment", host: "Host", staged_doc: dict[str, Any]) -> str | None:
    """Why HOST must not be launched with its staged Engram rows (None: they are its rank's rows)."""
    r = dep.recipe
    if not (r.engram and r.engram.placement == "nvme"):
        return None
    e = staged_doc.get("engram") or {}
    path = f"{dep.engram_dir(host)}/{ENGRAM_LOCAL}"
    if e.get("error") == "missing" or e.get("local") is None:
        why = e.get("error") or "missing"
        return (f"no Engram rows staged for rank {host.rank}: {path} is {why} "
                f"(run `deployctl stage -i {dep.cluster.file}` first)")
    got = _layers(e["local"])
    want = expected_engram(dep, host.rank)
    if got == want:
        return None
    owner = next((k for k in range(r.parallelism.nodes) if k != host.rank and expected_engram(dep, k) == got),
                 None)
    whose = f" (those are rank {owner}'s rows)" if owner is not None else ""
    return (f"staged Engram rows do not match rank {host.rank}: {path} holds {json.dumps(got)}{whose}, "
            f"rank {host.rank} owns {json.dumps(want)}; re-stage with `deployctl stage -i {dep.cluster.file}`")
