"""The serving API key against the released engines (#19): the engine double refuses and serves exactly
the requests vLLM's AuthenticationMiddleware and SGLang's decide_request_auth do, and the key deployctl
hands SGLang through its --config file is the api_key the released server arguments end up with."""
from __future__ import annotations

import itertools

import pytest

from orchestrator import apikey
from orchestrator.deployment import load_deployment
from orchestrator.launch.containerspec import planned_spec
from orchestrator.paths import INVENTORIES_DIR
from tests.conformance.engines import run_probe, versions
from tests.engine_double.engine_double import authorized

KEY = "sk-test-0123456789abcdef"
PATHS = ("/health", "/health_generate", "/ready", "/metrics", "/version", "/v1/models", "/v1/chat/completions",
         "/v1/completions", "/v2/rerank", "/inference/v1/generate", "/get_model_info", "/generate")
AUTH = (None, f"Bearer {KEY}", f"bearer {KEY}", "Bearer wrong-key-0000", f"Basic {KEY}", "Bearer", KEY,
        f"Bearer  {KEY}")
CASES = [{"method": m, "path": p, "authorization": a}
         for m, p, a in itertools.product(("GET", "POST", "OPTIONS"), PATHS, AUTH)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_double_decides_like_the_released_engine(engine):
    payload = {"keys": [KEY], "cases": CASES} if engine == "vllm" else {"key": KEY, "cases": CASES}
    ans = run_probe(f"{engine}_auth", payload)
    assert ans[f"{engine}_version"] == versions()[engine]
    double = [authorized(engine, [KEY], c["method"], c["path"], c["authorization"]) for c in CASES]
    wrong = [(c, r, d) for c, r, d in zip(CASES, ans["allowed"], double) if r != d]
    assert not wrong, wrong[:5]
    assert set(ans["status"]) == {None, 401}, "a refused request is a 401 in the released engine too"
    # what deployctl's probes rely on
    by = {(c["method"], c["path"], c["authorization"]): ok for c, ok in zip(CASES, ans["allowed"])}
    assert by[("GET", "/health", None)], f"{engine}: /health answers without the key"
    assert not by[("GET", "/v1/models", None)] and by[("GET", "/v1/models", f"Bearer {KEY}")]
    assert not by[("POST", "/v1/chat/completions", "Bearer wrong-key-0000")]


def test_sglang_gets_the_key_from_the_config_file_deployctl_writes(tmp_path):
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    inv = tmp_path / "local1.yml"
    inv.write_text((INVENTORIES_DIR / "local1.yml").read_text().replace(
        "  vars:\n", f"  vars:\n    api_key_file: {key_file}\n", 1))
    dep = load_deployment(inv)
    assert dep.recipe.engine.kind == "sglang" and dep.api_key is not None
    spec = planned_spec(dep, dep.cluster.hosts[0])
    assert KEY not in " ".join(spec.argv) and KEY not in repr(spec)
    ((host_path, _),) = spec.secret_files
    assert (host_path, apikey.SGLANG_CONFIG, "ro") in spec.mounts
    # the file as launch writes it (containers.write_secret_file), at the path the container sees
    conf = tmp_path / "sglang-api-key.yaml"
    conf.write_text(apikey.sglang_config(dep.api_key))
    argv = [str(conf) if a == apikey.SGLANG_CONFIG else a for a in spec.argv]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    ans = run_probe("sglang_auth", {"key": KEY, "cases": [], "argv": argv[3:]})
    assert ans["api_key"] == KEY


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_prometheus_scrapes_the_engine_without_the_key(engine):
    """`monitor config` gives the engine job no credentials (orchestrator/monitor/promconfig.py): the
    released engine must admit the scrape path without the key, however deployctl's key is set."""
    from orchestrator.monitor import promconfig
    (path,) = {j["metrics_path"] for j in promconfig.document("15s", "15s")["scrape_configs"]
               if j["job_name"] == "deployctl-engine"}
    cases = [{"method": "GET", "path": path, "authorization": None},
             {"method": "GET", "path": "/v1/models", "authorization": None}]         # the control: guarded
    payload = {"keys": [KEY], "cases": cases} if engine == "vllm" else {"key": KEY, "cases": cases}
    ans = run_probe(f"{engine}_auth", payload)
    assert ans["allowed"] == [True, False], ans
    assert authorized(engine, [KEY], "GET", path, None), "the double agrees"
