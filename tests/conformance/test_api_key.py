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
from tests.conformance.engines import run_probes, versions
from tests.engine_double.engine_double import authorized

KEY = "sk-test-0123456789abcdef"
PATHS = ("/health", "/health_generate", "/ready", "/metrics", "/version", "/v1/models", "/v1/chat/completions",
         "/v1/completions", "/v2/rerank", "/inference/v1/generate", "/get_model_info", "/generate")
AUTH = (None, f"Bearer {KEY}", f"bearer {KEY}", "Bearer wrong-key-0000", f"Basic {KEY}", "Bearer", KEY,
        f"Bearer  {KEY}")
CASES = [{"method": m, "path": p, "authorization": a}
         for m, p, a in itertools.product(("GET", "POST", "OPTIONS"), PATHS, AUTH)]


def _payload(engine: str, cases: list[dict], **more) -> dict:
    return {"keys": [KEY], "cases": cases, **more} if engine == "vllm" else {"key": KEY, "cases": cases, **more}


def scrape_cases() -> list[dict]:
    """The engine job's metrics path (`monitor config` gives it no credentials,
    orchestrator/monitor/promconfig.py) and a control the key guards."""
    from orchestrator.monitor import promconfig
    (path,) = {j["metrics_path"] for j in promconfig.document("15s", "15s")["scrape_configs"]
               if j["job_name"] == "deployctl-engine"}
    return [{"method": "GET", "path": path, "authorization": None},
            {"method": "GET", "path": "/v1/models", "authorization": None}]


def sglang_config_argv(d) -> list[str]:
    """The argv deployctl renders for a keyed SGLang deployment (inventories/local1.yml with
    api_key_file), its --config file written as launch writes it (containers.write_secret_file)."""
    key_file = d / "api.key"
    key_file.write_text(KEY + "\n")
    inv = d / "local1.yml"
    inv.write_text((INVENTORIES_DIR / "local1.yml").read_text().replace(
        "  vars:\n", f"  vars:\n    api_key_file: {key_file}\n", 1))
    dep = load_deployment(inv)
    assert dep.recipe.engine.kind == "sglang" and dep.api_key is not None
    spec = planned_spec(dep, dep.cluster.hosts[0])
    assert KEY not in " ".join(spec.argv) and KEY not in repr(spec)
    ((host_path, _),) = spec.secret_files
    assert (host_path, apikey.SGLANG_CONFIG, "ro") in spec.mounts
    conf = d / "sglang-api-key.yaml"
    conf.write_text(apikey.sglang_config(dep.api_key))
    argv = [str(conf) if a == apikey.SGLANG_CONFIG else a for a in spec.argv]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    return argv[3:]


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """Each engine's answers, one probe run per engine (its imports once): (engine, "cases") for
    CASES, (engine, "scrape") for scrape_cases(), ("sglang", "config") for the config file's key."""
    out = {}
    for engine in ("vllm", "sglang"):
        payloads = {"cases": _payload(engine, CASES), "scrape": _payload(engine, scrape_cases())}
        if engine == "sglang":
            payloads["config"] = _payload(engine, [], argv=sglang_config_argv(tmp_path_factory.mktemp("sglang-key")))
        for what, ans in zip(payloads, run_probes(f"{engine}_auth", list(payloads.values()))):
            out[(engine, what)] = ans
    return out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_double_decides_like_the_released_engine(answers, engine):
    ans = answers[(engine, "cases")]
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


def test_sglang_gets_the_key_from_the_config_file_deployctl_writes(answers):
    assert answers[("sglang", "config")]["api_key"] == KEY


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_prometheus_scrapes_the_engine_without_the_key(answers, engine):
    """`monitor config` gives the engine job no credentials (orchestrator/monitor/promconfig.py): the
    released engine must admit the scrape path without the key, however deployctl's key is set."""
    ans = answers[(engine, "scrape")]
    assert ans["allowed"] == [True, False], ans
    assert authorized(engine, [KEY], "GET", scrape_cases()[0]["path"], None), "the double agrees"
