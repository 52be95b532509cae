"""The serving API key (#19): a keyed TP=4 deployment on the 4-host test cluster, healthy, benchmarked and
torn down with the key never visible; a wrong key on the controller says so and leaves the engines
running; a new key relaunches them. The engine double enforces the key as vLLM does
(tests/conformance/test_api_key.py holds it to the released middleware). The inventory checks run
without the cluster."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.launch.containerspec import planned_spec
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.stages import build_plan
from tests.test_launch import (TP4, _docker, containers, double_image, dctl, engram_synth, out,  # noqa: F401
                               remove_all, engram_overrides, stage_for_real, unwrap, write_inventory)

KEY1 = "sk-deployctl-test-key-one-0123456789"
KEY2 = "sk-deployctl-test-key-two-9876543210"
DEP, PORT = "lk4", 18002


# -------------------------------------------------------------------------------- without a cluster

def _inventory(tmp_path: Path, **vars) -> Path:
    data = yaml.safe_load((INVENTORIES_DIR / "spark4.yml").read_text())
    data["all"]["vars"].update(vars)
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.mark.parametrize("vars, key, text", [
    ({"api_key_file": "missing.key"}, "all.vars.api_key_file", "cannot read the API key file"),
    ({"api_key_env": "DCTL_NO_SUCH_KEY_VAR"}, "all.vars.api_key_env", "is not set or empty"),
    ({"api_key_env": "not a name"}, "all.vars.api_key_env", "expected an environment variable name"),
    ({"api_key_file": "k", "api_key_env": "K"}, "all.vars.api_key_env", "not both"),
])
def test_bad_key_settings_name_the_inventory_key(tmp_path, vars, key, text):
    with pytest.raises(InputError) as e:
        load_deployment(_inventory(tmp_path, **vars))
    assert e.value.key == key and text in str(e.value) and e.value.exit_code == 2


def test_key_is_in_the_digest_never_in_argv_or_plan(tmp_path, monkeypatch):
    (tmp_path / "api.key").write_text(KEY1 + "\n")
    inv = _inventory(tmp_path, api_key_file="api.key")          # relative: to the inventory
    dep = load_deployment(inv)
    assert dep.api_key is not None and dep.api_key.value == KEY1
    open_dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    h = dep.cluster.hosts[0]
    keyed, plain = planned_spec(dep, h), planned_spec(open_dep, h)
    assert keyed.env["VLLM_API_KEY"] == "${DEPLOYCTL_API_KEY}" and keyed.digest != plain.digest
    (tmp_path / "api.key").write_text(KEY2)
    assert planned_spec(load_deployment(inv), h).digest != keyed.digest, "a new key is a new spec"
    monkeypatch.setenv("DCTL_TEST_API_KEY", KEY1)
    by_env = load_deployment(_inventory(tmp_path, api_key_env="DCTL_TEST_API_KEY"))
    assert planned_spec(by_env, h).digest == keyed.digest, "same key, same spec, wherever it is kept"
    plan = build_plan(dep)
    text = json.dumps(plan.to_json())
    assert KEY1 not in text and KEY2 not in text and dep.api_key.key_id in text
    assert all(KEY2 not in " ".join(a.command) for s in plan.stages for a in s.actions)


def test_rotation_names_key_ids_and_hosts():
    from orchestrator.apikey import ApiKey, rotation
    key = ApiKey(KEY1, "test")
    assert rotation({"a": key.key_id, "b": key.key_id}, key) is None
    assert rotation({"a": None}, None) is None
    assert rotation({"a": "", "b": key.key_id}, key) == \
        f"the API key changed (id none -> {key.key_id}): launch relaunches the engines on a"
    assert rotation({"a": key.key_id}, None) == f"the API key changed (id {key.key_id} -> none): launch relaunches every engine"


def test_engine_args_cannot_carry_the_key(tmp_path):
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.args.api-key=sk-in-argv-123",))
    with pytest.raises(InputError, match="api_key_file or api_key_env"):
        planned_spec(dep, dep.cluster.hosts[0])


# ------------------------------------------------------------------------------------ on the cluster

@pytest.fixture(scope="module")
def keyed(cluster, double_image, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("keyed")
    key_file = d / "api.key"
    key_file.write_text(KEY1 + "\n")
    synth = engram_synth(d)
    inv = write_inventory(cluster, d / "inventory.yml", DEP, TP4, [h.name for h in cluster.hosts], PORT,
                          {"engine.master_port": 29621, **engram_overrides(synth)})
    data = yaml.safe_load(inv.read_text())
    data["all"]["vars"]["api_key_file"] = str(key_file)
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    stage_for_real(inv, synth)
    dep = load_deployment(inv)
    remove_all(cluster, DEP)
    yield {"inv": inv, "key_file": key_file, "dep": dep, "dir": d}
    remove_all(cluster, DEP)


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _nowhere(texts: list[str], *keys: str) -> None:
    for k in keys:
        assert not any(k in t for t in texts), f"the key {k[:10]}... leaked"


def test_keyed_deployment_end_to_end(cluster, keyed):
    inv, dep = keyed["inv"], keyed["dep"]
    seen: list[str] = []
    p = dctl("plan", "-i", str(inv))
    assert p.returncode == 0, out(p)
    assert "API key from file" in unwrap(p.stdout) and dep.api_key.key_id in p.stdout
    seen.append(out(p))

    p = dctl("up", "-i", str(inv), "--only", "launch", "--only", "health", timeout=240)
    seen.append(out(p))
    assert p.returncode == 0, out(p)
    assert "chat answered" in unwrap(out(p))
    run_dir = Path(re.search(r"run record (\S+)", unwrap(out(p))).group(1))
    seen += [f.read_text(errors="replace") for f in run_dir.rglob("*") if f.is_file()]

    # the engines require the key; /health stays open (as in vLLM)
    url = dep.api_url
    assert _get(f"{url}/v1/models") == 401 and _get(f"{url}/v1/models", KEY2) == 401
    assert _get(f"{url}/v1/models", KEY1) == 200 and _get(f"{url}/health") == 200
    ids = {}
    for h in cluster.hosts:
        (cid,) = containers(cluster, h.name, DEP)
        ids[h.name] = cid
        doc = json.loads(_docker(h.docker_host, "inspect", cid).stdout)[0]
        seen.append(json.dumps([doc["Config"]["Cmd"], doc["Args"], doc["Path"], doc["Config"]["Labels"]]))
        assert f"VLLM_API_KEY={KEY1}" in doc["Config"]["Env"], "delivered through the environment"
        assert doc["Config"]["Labels"]["deployctl.api-key-id"] == dep.api_key.key_id

    p = dctl("status", "-i", str(inv), "--json")
    seen.append(out(p))
    assert p.returncode == 0, out(p)
    doc = json.loads(p.stdout)
    assert doc["api"]["healthy"] is True
    assert {c["api_key_id"] for row in doc["hosts"] for c in row["containers"]} == {dep.api_key.key_id}

    p = dctl("bench", "-i", str(inv), "--concurrency", "1,2", "--rounds", "1", "--max-tokens", "8",
             "--input-tokens", "16", "--no-warmup", "--json", timeout=240)
    seen.append(out(p))
    assert p.returncode == 0, out(p)
    levels = json.loads(p.stdout)["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2], levels
    assert all(lv["errors"] == 0 and lv["completed"] == lv["requests"] > 0 for lv in levels), levels

    # a wrong key on the controller: said so, nothing torn down
    keyed["key_file"].write_text(KEY2 + "\n")
    p = dctl("health", "-i", str(inv), timeout=120)
    seen.append(out(p))
    assert p.returncode == 1, out(p)
    assert "the API rejects the key" in unwrap(out(p)) and "left running" in unwrap(out(p))
    p = dctl("status", "-i", str(inv), "--json")
    assert json.loads(p.stdout)["api"]["key_rejected"] is True
    p = dctl("plan", "-i", str(inv), "--check", timeout=120)
    seen.append(out(p))
    assert p.returncode == 0, out(p)
    new_id = load_deployment(inv).api_key.key_id
    assert f"the API key changed (id {dep.api_key.key_id} -> {new_id}): launch relaunches every engine" \
        in unwrap(out(p))
    assert {h.name: containers(cluster, h.name, DEP) for h in cluster.hosts} == {n: [c] for n, c in ids.items()}

    # rotation: `up` with the new key relaunches every engine with it
    p = dctl("up", "-i", str(inv), "--only", "launch", "--only", "health", timeout=240)
    seen.append(out(p))
    assert p.returncode == 0, out(p)
    assert "the API key changed" in unwrap(out(p))
    assert _get(f"{url}/v1/models", KEY2) == 200 and _get(f"{url}/v1/models", KEY1) == 401
    assert all(containers(cluster, h.name, DEP) != [ids[h.name]] for h in cluster.hosts)
    run_dir = Path(re.search(r"run record (\S+)", unwrap(out(p))).group(1))
    seen += [f.read_text(errors="replace") for f in run_dir.rglob("*") if f.is_file()]

    p = dctl("down", "-i", str(inv))
    seen.append(out(p))
    assert p.returncode == 0, out(p)
    _nowhere(seen, KEY1, KEY2)


def test_keyed_sglang_reads_the_key_from_its_config_file(cluster, double_image, tmp_path, monkeypatch):
    """SGLang has no environment variable for the key: launch writes its --config file (0600) on the host
    and mounts it read-only; the engine then refuses /v1 without the key, and nothing shows the key."""
    from tests import synth
    from tests.test_launch import QWEN, QWEN_SMALL
    monkeypatch.setenv("DCTL_SGLANG_TEST_KEY", KEY1)
    inv = write_inventory(cluster, tmp_path / "inventory.yml", "lk1", QWEN, ["node1"], 18003, QWEN_SMALL)
    data = yaml.safe_load(inv.read_text())
    data["all"]["vars"]["api_key_env"] = "DCTL_SGLANG_TEST_KEY"
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    dep = load_deployment(inv)
    h = dep.cluster.host("node1")
    synth.write_checkpoint(Path(dep.checkpoint_dir(h)), [t for t in synth.recipe_tensors(dep.recipe)
                                                         if ".ple." in t.name], files=2,
                           config=synth.recipe_config(dep.recipe))
    try:
        p = dctl("up", "-i", str(inv), "--only", "write-ple", "--only", "launch", "--only", "health", timeout=240)
        assert p.returncode == 0, out(p)
        (cid,) = containers(cluster, "node1", "lk1")
        doc = json.loads(_docker(h.docker_host, "inspect", cid).stdout)[0]
        assert "--config" in doc["Config"]["Cmd"]
        conf = next(m for m in doc["Mounts"] if m["Destination"] == "/run/deployctl/sglang-api-key.yaml")
        assert conf["RW"] is False and (Path(conf["Source"]).stat().st_mode & 0o777) == 0o600
        url = dep.api_url
        assert _get(f"{url}/health") == 200 and _get(f"{url}/v1/models") == 401
        assert _get(f"{url}/v1/models", KEY1) == 200
        _nowhere([out(p), json.dumps([doc["Config"]["Cmd"], doc["Args"], doc["Config"]["Env"]])], KEY1)
    finally:
        dctl("down", "-i", str(inv))
