"""Bad input gets a clear error naming file, key path and what to do, and exit code 2."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.inventory import load_inventory
from orchestrator.paths import INVENTORIES_DIR, RECIPES_DIR
from orchestrator.recipe import load_recipe

GOOD_INV = textwrap.dedent("""\
    all:
      vars:
        recipe: deepseek-v41-flash-tp4
        head: s1
      hosts:
        s1: {ansible_host: 10.0.0.1, rank: 0, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
        s2: {ansible_host: 10.0.0.2, rank: 1, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
        s3: {ansible_host: 10.0.0.3, rank: 2, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
        s4: {ansible_host: 10.0.0.4, rank: 3, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}
    """)


def write(tmp_path: Path, text: str, name: str = "inv.yml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def recipe_copy(tmp_path: Path, name: str, edit) -> Path:
    text = edit((RECIPES_DIR / f"{name}.yml").read_text())
    return write(tmp_path, text, "recipe.yml")


def test_good_inventory_loads(tmp_path):
    dep = load_deployment(write(tmp_path, GOOD_INV))
    assert [h.rank for h in dep.cluster.hosts] == [0, 1, 2, 3]
    assert dep.cluster.head_host.name == "s1"


def test_unknown_recipe_key_is_an_error_not_a_default(tmp_path):
    p = recipe_copy(tmp_path, "deepseek-v41-flash-tp4",
                    lambda t: t.replace("  tensor_parallel: 4", "  tensor_paralel: 4"))
    with pytest.raises(InputError) as e:
        load_recipe(str(p))
    msg = str(e.value)
    assert str(p) in msg and "parallelism.tensor_paralel" in msg and "unknown key" in msg
    assert e.value.line is not None  # points at the line


def test_unknown_inventory_host_key(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("nvme_dir: /n, model_cache: /m}\n    s2",
                                         "nvme_dir: /n, model_cache: /m, nvme_dri: /x}\n    s2"))
    with pytest.raises(InputError) as e:
        load_inventory(p)
    assert "nvme_dri" in str(e.value) and "s1" in str(e.value) and str(p) in str(e.value)


def test_duplicate_ranks(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("10.0.0.2, rank: 1", "10.0.0.2, rank: 0"))
    with pytest.raises(InputError, match=r"duplicate rank 0: hosts 's1' and 's2'"):
        load_inventory(p)


def test_duplicate_addresses(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("10.0.0.2", "10.0.0.1"))
    with pytest.raises(InputError, match=r"duplicate address 10.0.0.1:22"):
        load_inventory(p)


def test_missing_head(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("    head: s1\n", ""))
    with pytest.raises(InputError) as e:
        load_inventory(p)
    assert "missing head" in str(e.value) and "all.vars.head" in str(e.value)


def test_head_not_a_host(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("head: s1", "head: s9"))
    with pytest.raises(InputError, match="head 's9' is not a host"):
        load_inventory(p)


def test_head_must_be_rank_0(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("head: s1", "head: s2"))
    with pytest.raises(InputError, match="the head must be rank 0"):
        load_inventory(p)


def test_rank_gap(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("10.0.0.4, rank: 3", "10.0.0.4, rank: 7"))
    with pytest.raises(InputError, match=r"ranks must be 0..3 without gaps"):
        load_inventory(p)


def test_tp_not_nodes_times_gpus_in_recipe(tmp_path):
    p = recipe_copy(tmp_path, "deepseek-v41-flash-tp4",
                    lambda t: t.replace("  gpus_per_node: 1", "  gpus_per_node: 2"))
    with pytest.raises(InputError) as e:
        load_recipe(str(p))
    assert "tensor_parallel 4 != nodes 4 x gpus_per_node 2" in str(e.value)
    assert "parallelism.tensor_parallel" in str(e.value)


def test_tp_against_inventory_node_count(tmp_path):
    three = GOOD_INV.split("    s4:")[0]
    with pytest.raises(InputError) as e:
        load_deployment(write(tmp_path, three))
    assert "needs 4 node(s)" in str(e.value) and "the inventory has 3" in str(e.value)


def test_gpus_per_node_against_inventory(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("10.0.0.3, rank: 2, hardware: dgx-spark, gpus: 1",
                                         "10.0.0.3, rank: 2, hardware: dgx-spark, gpus: 0"))
    with pytest.raises(InputError, match="host s3 has 0 GPU"):
        load_deployment(p)


def test_pinned_on_spark_is_refused_with_the_reason(tmp_path):
    with pytest.raises(InputError) as e:
        load_recipe("qwen38-flash-next-spark", ["ple.placement=pinned"])
    msg = str(e.value)
    assert "ple.placement" in msg and "frees nothing" in msg and "nvme" in msg


def test_pinned_on_rtx_is_allowed():
    assert load_recipe("qwen38-flash-next-rtx").recipe.ple.placement == "pinned"


def test_malformed_yaml_names_the_line(tmp_path):
    p = write(tmp_path, "all:\n  vars:\n    head: s1\n  hosts: [unclosed\n    s1: {}\n")
    with pytest.raises(InputError) as e:
        load_inventory(p)
    assert "malformed YAML" in str(e.value) and e.value.line is not None
    assert f"{p}:{e.value.line}" in str(e.value)


def test_set_override_of_unknown_key(tmp_path):
    with pytest.raises(InputError, match="unknown key 'placment'"):
        load_recipe("deepseek-v41-flash-tp4", ["engram.placment=memory"])


def test_set_override_type_checked():
    with pytest.raises(InputError, match="parallelism.nodes: expected an integer"):
        load_recipe("deepseek-v41-flash-tp4", ["parallelism.nodes=four"])


def test_set_override_applies():
    r = load_recipe("deepseek-v41-flash-tp4", ["engram.placement=memory",
                                               "engine.args.max-num-seqs=4"]).recipe
    assert r.engram.placement == "memory" and r.engine.args["max-num-seqs"] == 4


def test_wrong_hardware_for_recipe(tmp_path):
    p = write(tmp_path, GOOD_INV.replace("10.0.0.1, rank: 0, hardware: dgx-spark",
                                         "10.0.0.1, rank: 0, hardware: rtx-pro-6000"))
    with pytest.raises(InputError, match="host s1 is rtx-pro-6000 but recipe"):
        load_deployment(p)


@pytest.mark.parametrize("args, needle", [
    (["plan", "-i", "{inv}", "--set", "engram.placment=memory"], "unknown key 'placment'"),
    (["plan", "-i", "/nonexistent/inv.yml"], "file not found"),
    (["plan", "-i", "{inv}", "--recipe", "no-such-recipe"], "no recipe named 'no-such-recipe'"),
    (["up", "-i", "{inv}", "--dry-run", "--only", "nosuchstage"], "unknown stage 'nosuchstage'"),
])
def test_cli_bad_input_exits_2(tmp_path, args, needle):
    inv = write(tmp_path, GOOD_INV)
    argv = [a.replace("{inv}", str(inv)) for a in args]
    p = subprocess.run([sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert "Traceback" not in p.stderr


def test_example_inventories_are_valid():
    for name in ("spark4", "spark8", "spark1", "rtx1"):
        dep = load_deployment(INVENTORIES_DIR / f"{name}.yml")
        assert dep.cluster.head_host.rank == 0
