"""The download as one container run on the head, and its progress on the console.

The serving image is already on the head when fetch-model runs (build is native there) and ships
huggingface_hub (vLLM and SGLang depend on it), so a fresh head needs nothing installed: the stage
runs hostside/hubfetch.py `fetch` with the image's python3, as the head's user (the cache stays
theirs), with the model cache and deployctl's state folder mounted at the same paths, the token
inside the job on stdin. A container left by an interrupted run (Ctrl-C, a lost controller) is
removed first; its partial file stays, and this run resumes it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from ..executors.docker_cli import docker_argv
from ..hostside.hubfetch import BOOTSTRAP
from ..modelsync.progress import Progress
from ..modelsync.settings import cache_file
from .resolve import job_base, script
from .resolved import Resolved

if TYPE_CHECKING:
    from ..deployment import Deployment

KILL_GRACE_S = 30
BASE_TIMEOUT_S = 600
MIN_RATE = 20e6                       # B/s the whole-download timeout assumes at least


def container_name(dep: "Deployment") -> str:
    return f"deployctl-fetch-{dep.name}"


@dataclass(frozen=True)
class FetchJob:
    image: str
    container: str
    argv: tuple[str, ...]             # on the head, the `timeout`-bounded docker run (the plan shows it;
                                      # the script and the job arrive on stdin)
    job: dict[str, Any]               # the hostside job without the token (plans and records show it)
    bytes: int                        # still to download
    timeout_s: int


def make_job(dep: "Deployment", r: Resolved, rehash: bool = False) -> FetchJob:
    head = dep.cluster.head_host
    job = {**job_base(dep, rehash), "commit": r.commit, "files": list(r.files),
           "modelsync_cache": cache_file(head.nvme_dir, dep.checkpoint_dir(head))}
    state_dir = str(PurePosixPath(head.nvme_dir) / ".deployctl")
    todo = int(r.check.get("need_bytes", r.total)) if r.check else r.total
    timeout_s = int(BASE_TIMEOUT_S + todo / MIN_RATE)
    name = container_name(dep)
    run = docker_argv(head, "run", "--rm", "-i", "--name", name, "--network", "host",
                      "--user", f"{r.uid}:{r.gid}", "--entrypoint", "python3",
                      "-e", f"HF_ENDPOINT={dep.cluster.hf_endpoint}",      # the client's own setting
                      "-e", "HF_HOME=/tmp/deployctl-hf-home", "-e", "HF_HUB_DISABLE_PROGRESS_BARS=1",
                      "-e", "HF_HUB_DISABLE_TELEMETRY=1",
                      "-v", f"{head.model_cache}:{head.model_cache}", "-v", f"{state_dir}:{state_dir}",
                      dep.recipe.engine.image, "-c", BOOTSTRAP, str(len(script())), "fetch")
    argv = ("timeout", "-k", str(KILL_GRACE_S), str(timeout_s), *run)
    return FetchJob(dep.recipe.engine.image, name, argv, job, todo, timeout_s)


class FetchProgress(Progress):
    """modelsync's per-host progress (bytes, rate, ETA at every further 10 % or 30 s) fed from
    hubfetch's `progress {json}` lines, with the current file's bytes; other lines go to the host's log."""

    def line(self, text: str) -> None:
        if not text.startswith("progress "):
            self.log.write(text)
            return
        try:
            doc = json.loads(text[len("progress "):])
        except ValueError:
            return
        self.total = int(doc.get("total") or self.total)
        self.update(int(doc.get("done", 0)) + int(doc.get("file_done", 0)), self.file_text(doc))

    @staticmethod
    def file_text(doc: dict[str, Any]) -> str:
        size = int(doc.get("file_size") or 0)
        done = int(doc.get("file_done") or 0)
        return f"{doc.get('file')}: {done / 1e9:.2f} of {size / 1e9:.2f} GB" if size else str(doc.get("file"))


def job_stdin(fj: FetchJob, token: str) -> bytes:
    return script() + json.dumps({**fj.job, "token": token}).encode()
