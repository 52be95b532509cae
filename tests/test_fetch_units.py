"""fetch-model's pure parts: the token, the inventory keys, the allow patterns (against the released
huggingface_hub's own filter), how the plan words a revision, and what planning shows without a host."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub.utils import filter_repo_objects

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.hostside.hubfetch import selected
from orchestrator.inventory import load_inventory
from orchestrator.modelfetch.access import load_access
from orchestrator.modelsync.settings import revision_note
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.secrets import mask_text
from orchestrator.stages import build_plan

NAMES = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "README.md",
         "original/consolidated.00.pth", "tokenizer/tokenizer.json", "tokenizer.model", ".gitattributes",
         "sub/dir/deep.safetensors", "inference/encoding_dsv4.py"]
PATTERNS = [[], ["*.json"], ["*.safetensors", "*.json"], ["tokenizer/"], ["original/*"], ["*"], ["sub/"],
            ["model-*.safetensors", "tokenizer*"], ["inference/*.py", "*.md"]]


@pytest.mark.parametrize("allow", PATTERNS)
def test_allow_patterns_select_what_huggingface_hub_selects(allow):
    want = list(filter_repo_objects(NAMES, allow_patterns=allow or None))
    assert selected(NAMES, allow) == want


def inventory(tmp_path: Path, **extra) -> Path:
    doc = yaml.safe_load((INVENTORIES_DIR / "spark4.yml").read_text())
    doc["all"]["vars"].update(extra)
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_token_from_env_or_file_is_a_secret(tmp_path):
    c = load_inventory(inventory(tmp_path))
    a = load_access(c, {"HF_TOKEN": "hf_env_token_value_1234"})
    assert a.token == "hf_env_token_value_1234" and a.token_source == "environment variable HF_TOKEN"
    assert "hf_env_token_value_1234" not in mask_text("token hf_env_token_value_1234 leaked")
    assert "hf_env_token_value_1234" not in repr(a)
    (tmp_path / "tok").write_text("hf_file_token_value_5678\n")
    a = load_access(load_inventory(inventory(tmp_path, hf_token_file="tok")), {"HF_TOKEN": "ignored_x"})
    assert a.token == "hf_file_token_value_5678" and a.token_source.startswith("file ")
    assert load_access(c, {}).token == ""


@pytest.mark.parametrize("key, value, says", [
    ("model_fetch", "maybe", "expected hub or none"),
    ("hf_endpoint", "huggingface.co", "expected an http(s) URL"),
    ("hf_token_file", "missing-token", "cannot read the Hub token file"),
])
def test_bad_inventory_values_name_the_key(tmp_path, key, value, says):
    inv = inventory(tmp_path, **{key: value})
    with pytest.raises(InputError) as e:
        load_access(load_inventory(inv), {})
    assert e.value.key == f"all.vars.{key}" and says in str(e.value)
    p = subprocess.run([sys.executable, "-m", "orchestrator", "fetch-model", "-i", str(inv)], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert p.returncode == 2 and f"all.vars.{key}" in p.stderr, p.stderr


def test_revision_note_says_pinned_or_not():
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert "pinned commit" in revision_note(commit, "")
    note = revision_note("main", "", commit)
    assert "= commit 0123456789ab" in note and "NOT pinned" in note and commit in note
    assert "NOT pinned" in revision_note("main", "")


def test_plan_without_hosts_says_when_the_revision_is_resolved(tmp_path):
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    assert dep.checkpoint is None and dep.snapshot == "main"     # nothing resolved: planning is pure
    (a,) = build_plan(dep, only=("fetch-model",)).stage("fetch-model").actions
    assert a.host == "spark1" and "when the run starts" in a.summary and "NOT pinned" in a.summary
    assert a.command and a.command[0] == "python3" and a.command[-1] == "resolve"
    off = load_deployment(inventory(tmp_path, model_fetch="none"))
    st = build_plan(off, only=("fetch-model",)).stage("fetch-model")
    assert st.actions == () and "model_fetch: none" in st.note
