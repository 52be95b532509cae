"""The Hub endpoint double (tests/hub_endpoint.py) and fetch-model's host script
(orchestrator/hostside/hubfetch.py) against the released huggingface_hub client (the test extra's pin).

The double must answer what the real client asks the way huggingface.co does (model_info with file
metadata, file metadata from HEAD, Range downloads, errors by X-Error-Code), and what hubfetch writes
must be a cache the real client reads as its own (hf_hub_download offline, scan_cache_dir).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.hub_endpoint import publish, serve

from huggingface_hub import HfApi, hf_hub_download, scan_cache_dir
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_conformance_token_000000000000"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    src = tmp_path_factory.mktemp("src")
    (src / "model-00001-of-00001.safetensors").write_bytes(os.urandom(3_000_000))
    (src / "config.json").write_text('{"model_type": "synthetic"}')
    (src / "sub").mkdir()
    (src / "sub" / "tokenizer.json").write_text('{"v": 1}')
    commit = publish(root, "org/open", src)
    publish(root, "org/gated", src, gated=True, tokens=(TOKEN,))
    srv = serve(root, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", root, src, commit
    srv.shutdown()


def test_model_info_and_downloads_through_the_real_client(endpoint, tmp_path):
    url, _, src, commit = endpoint
    info = HfApi(endpoint=url).model_info("org/open", revision="main", files_metadata=True)
    assert info.sha == commit
    sib = {s.rfilename: s for s in info.siblings}
    shard = src / "model-00001-of-00001.safetensors"
    assert sib[shard.name].lfs.sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert sib["config.json"].lfs is None and sib["config.json"].size == len((src / "config.json").read_bytes())
    path = hf_hub_download("org/open", shard.name, revision="main", cache_dir=tmp_path, endpoint=url)
    assert Path(path).read_bytes() == shard.read_bytes()
    assert f"snapshots/{commit}/" in path


def test_errors_are_the_clients_own(endpoint, tmp_path):
    url = endpoint[0]
    api = HfApi(endpoint=url)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/open", revision="v0-missing")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json", cache_dir=tmp_path, endpoint=url)
    assert hf_hub_download("org/gated", "config.json", cache_dir=tmp_path, endpoint=url, token=TOKEN)


def hubfetch(op: str, job: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "orchestrator" / "hostside" / "hubfetch.py"), op],
                          input=json.dumps(job), capture_output=True, text=True, timeout=120)


def test_hubfetch_writes_a_cache_the_client_reads_as_its_own(endpoint, tmp_path):
    url, _, src, commit = endpoint
    base = {"endpoint": url, "repo": "org/open", "revision": "main", "allow": ["*.json", "*.safetensors"],
            "model_cache": str(tmp_path / "cache"), "state": str(tmp_path / "state.json"), "ask_hub": True}
    r = hubfetch("resolve", base)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["commit"] == commit and res["check"]["up_to_date"] is False
    assert sorted(f["name"] for f in res["files"]) == ["config.json", "model-00001-of-00001.safetensors",
                                                      "sub/tokenizer.json"]   # "*" crosses "/" (fnmatch)
    f = hubfetch("fetch", {**base, "commit": commit, "files": res["files"]})
    assert f.returncode == 0, f.stderr
    for name in ("config.json", "sub/tokenizer.json", "model-00001-of-00001.safetensors"):
        p = hf_hub_download("org/open", name, revision="main", cache_dir=tmp_path / "cache", local_files_only=True)
        assert Path(p).read_bytes() == (src / name).read_bytes()
    scan = scan_cache_dir(tmp_path / "cache")
    assert not scan.warnings and [r.repo_id for r in scan.repos] == ["org/open"]
    assert json.loads(hubfetch("check", {**base, "commit": commit, "files": res["files"]}).stdout)["up_to_date"]
