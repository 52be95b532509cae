"""What launch and status read from a host before acting (network facts from fabric.py's
FACTS_SCRIPT, the staged tables, the image, the deployment's containers: one SSH round trip), and
whether the staged Engram rows are this host's rank's rows.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..outcomes import HostFailure
from ..hostside.engram_checks import check_rank
from ..hostside.engram_spec import LOCAL_NAME, MANIFEST_NAME, RankMismatch
from ..hostside.geometry import rank_ranges
from .commands import read_argv
from .containers import Container, parse_list
from ..fabric.detect import FACTS_SCRIPT
from ..executors.shells import HostShell

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host

# argv[1] = Engram folder or "", argv[2] = PLE folder or "". Prints one JSON object. The Engram
# manifest and engram-local.json (small) come back as text, for engram_checks.check_rank; the
# file names are the staging stages' (hostside/engram_stage.py, hostside/ple_write.py).
STAGED_SCRIPT = r"""
import glob, hashlib, json, os, sys
eng, ple = sys.argv[1], sys.argv[2]
out = {}
if eng:
    texts = {}
    for name in ("engram-local.json", "engram-manifest.json"):
        try:
            with open(os.path.join(eng, name)) as f:
                texts[name] = f.read(1 << 20)
        except OSError:
            texts[name] = None
    out["engram"] = {"dir": eng, "texts": texts}
if ple:
    digests = {}
    for p in sorted(glob.glob(os.path.join(ple, "ple_table_*.bin.deployctl-manifest.json"))):
        try:
            with open(p, "rb") as f:
                raw = f.read()
            digests[os.path.basename(p)] = json.loads(raw).get("content_digest") or hashlib.sha256(raw).hexdigest()
        except (OSError, ValueError, AttributeError):
            digests[os.path.basename(p)] = None
    out["ple"] = {"dir": ple, "digests": digests,
                  "tables": [[os.path.basename(p), os.path.getsize(p)]
                             for p in sorted(glob.glob(os.path.join(ple, "ple_table_*.bin")))],
                  # every table has its own manifest beside it (hostside/ple_write.py MANIFEST_SUFFIX)
                  "manifest": all(os.path.exists(p + ".deployctl-manifest.json")
                                  for p in glob.glob(os.path.join(ple, "ple_table_*.bin")))}
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


def table_digests(staged: dict[str, Any]) -> dict[str, str]:
    """{"engram" | "ple": content digest} of what the host's staged tables hold, from their manifests
    (the `content_digest` the stages record; the manifest's own sha256 for an older one). Empty for a
    recipe with nothing on NVMe; "none" when a manifest is missing (launch's checks refuse that)."""
    out: dict[str, str] = {}
    if "engram" in staged:
        text = (staged["engram"].get("texts") or {}).get(MANIFEST_NAME)
        try:
            doc = json.loads(text) if text else None
        except ValueError:
            doc = None
        out["engram"] = ((doc.get("content_digest") if isinstance(doc, dict) else None)
                         or (hashlib.sha256(text.encode()).hexdigest() if text else "none"))
    if "ple" in staged:
        digests = staged["ple"].get("digests") or {}
        out["ple"] = hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest() if digests else "none"
    return out


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


def engram_problem(dep: "Deployment", host: "Host", staged_doc: dict[str, Any]) -> str | None:
    """Why HOST must not be launched with its staged Engram rows (None: they are its rank's rows).
    engram_checks.check_rank decides, reading the two files the host sent back (staged_doc)."""
    r = dep.recipe
    if not (r.engram and r.engram.placement == "nvme"):
        return None
    e = staged_doc.get("engram") or {}
    folder = e.get("dir") or dep.engram_dir(host)
    texts = {f"{folder}/{name}": text for name, text in (e.get("texts") or {}).items()}
    try:
        check_rank(folder, expected_engram(dep, host.rank), read_text=texts.get)
        return None
    except RankMismatch as x:
        why = str(x)
    try:
        local = json.loads(texts.get(f"{folder}/{LOCAL_NAME}") or "null")
    except ValueError:
        local = None
    staged = local.get("layers") if isinstance(local, dict) else None
    owner = next((k for k in range(r.parallelism.nodes)
                  if staged and k != host.rank and expected_engram(dep, k) == staged), None)
    whose = f" (those are rank {owner}'s rows)" if owner is not None else ""
    return f"Engram rows of rank {host.rank}: {why}{whose}"
