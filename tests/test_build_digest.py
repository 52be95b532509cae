"""Image chains without an engine: loading and checks, the per-step digest, hashing, the build plan."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from orchestrator.errors import InputError
from orchestrator.imagechain.context import TarBuilder
from orchestrator.imagechain.digest import hash_tree, step_digest, step_material
from orchestrator.imagechain.spec import CHAINS_DIR, check_inputs, git_head, load_chain
from orchestrator.paths import ROOT

MINI = ROOT / "tests" / "fixtures" / "mini-vllm"


def mini_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "inputs"
    shutil.copytree(MINI, dst)
    return dst


def test_shipped_chains_load_and_the_real_ones_name_what_the_reports_say():
    for f in CHAINS_DIR.glob("*.yml"):
        if not f.name.endswith(".lock.yml"):
            load_chain(f.stem)
    v = load_chain("vllm-dsv41")
    assert [s.name for s in v.steps] == ["c-ext", "overlay1", "overlay3", "overlay4", "overlay5", "patch"]
    assert [s.kind for s in v.steps][:2] == ["run-copy-out", "docker-build"]
    assert v.lock.base.image == "vllm/vllm-openai:nightly-8a728663c1c3eeace834a95f5654fa653cc1998c"
    assert v.vars["flashinfer_ref"] == "07869c61" and v.vars["flashinfer_version"] == "0.7.0rc1"
    assert [p.git_commit for p in v.lock.pins] == ["e47aa780b"]
    patch = v.step("patch")
    assert patch.target == "/usr/local/lib/python3.12/dist-packages/vllm"
    assert len(patch.patches) == 7
    assert patch.patches[0].dest == "models/deepseek_v4_1/common/engram.py"
    assert v.step("overlay5").verify.expect_lines == ("VERIFY mxfp8: HIT", "VERIFY sparse_mla: HIT")
    assert v.step("overlay5").verify.expect == "" and "/opt/deployctl/verify5.py" in v.step("overlay5").verify.command
    assert "MAX_JOBS=2" in v.step("overlay5").verify.command and v.step("overlay4").args == {"MAXJ": "2"}
    assert v.step("patch").patches_dir == "patch"
    scripts = {i.src for s in v.steps for i in s.inputs if i.src.startswith("build/")}
    assert scripts == {"build/Dockerfile.overlay", "build/build_overlay3.sh", "build/build_overlay4.sh",
                       "build/build_overlay5.sh", "build/prewarm5.py", "build/verify5.py"}
    assert "bash build/build_stable_ext.sh" in v.step("c-ext").script
    assert v.step("overlay1").inputs[0].src == "vllm/vllm" and v.step("overlay1").uses == ("c-ext",)
    assert v.step("c-ext").outputs == ("vllm/vllm/_C_stable_libtorch*.so", "vllm/vllm/_moe_C_stable_libtorch*.so")
    # the real chain's inputs are not here: the check says where they are expected
    with pytest.raises(InputError, match="not found"):
        check_inputs(v)


def test_paths_inside_the_image_are_variables():
    t = load_chain("test-double", var_overrides={"python_version": "3.12"})
    assert t.step("patch").target == "/usr/local/lib/python3.12/dist-packages/vllm"
    with pytest.raises(InputError, match="no such variable"):
        load_chain("test-double", var_overrides={"pyhton_version": "3.12"})


def test_overlay1_pointed_at_the_checkout_is_explained():
    t = load_chain("test-double", var_overrides={"vllm_package": "vllm"})
    with pytest.raises(InputError) as e:
        check_inputs(t)
    msg = str(e.value)
    assert "source checkout, not the Python package" in msg
    assert "vllm/vllm/__init__.py but no vllm/__init__.py" in msg
    assert "src: vllm/vllm" in msg
    check_inputs(load_chain("test-double"))      # the shipped value is right


def test_missing_patch_file_and_unknown_keys_are_input_errors(tmp_path):
    inputs = mini_copy(tmp_path)
    (inputs / "patch" / "sparse_swa.py").unlink()
    with pytest.raises(InputError, match=r"patch 6 \(sparse_swa.py"):
        check_inputs(load_chain("test-double", inputs_dir=str(inputs)))
    bad = tmp_path / "bad.yml"
    bad.write_text((CHAINS_DIR / "test-double.yml").read_text().replace("    timeout_s: 300\n", "    timout_s: 300\n", 1))
    shutil.copy(CHAINS_DIR / "test-double.lock.yml", tmp_path / "bad.lock.yml")
    (tmp_path / "bad.lock.yml").write_text((CHAINS_DIR / "test-double.lock.yml").read_text())
    with pytest.raises(InputError, match="unknown key 'timout_s'") as e:
        load_chain(str(bad))
    assert e.value.line is not None


def test_git_pin_is_checked(tmp_path):
    repo = tmp_path / "co"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a").write_text("a")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "-C", str(repo), "add", "a"], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "x"], check=True, env=env)
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_head(repo) == sha
    subprocess.run(["git", "-C", str(repo), "pack-refs", "--all"], check=True)
    assert git_head(repo) == sha
    assert git_head(tmp_path) is None


def test_step_digest_is_pure_and_covers_its_inputs():
    base = dict(kind="docker-build", chain="c", step="s", platform="linux/amd64", text="FROM x\n", args={"A": "1"},
                inputs=[("vllm", "h1")], parent_id="sha256:p", uses={})
    d = step_digest(step_material(**base))
    assert d == step_digest(step_material(**base)) and d.startswith("sha256:")
    for change in ({"text": "FROM x\nRUN y\n"}, {"args": {"A": "2"}}, {"inputs": [("vllm", "h2")]},
                   {"parent_id": "sha256:q"}, {"uses": {"c-ext": "sha256:z"}}, {"platform": "linux/arm64"}):
        assert step_digest(step_material(**{**base, **change})) != d, change
    # order of args and inputs does not matter
    assert step_digest(step_material(**{**base, "args": {"B": "2", "A": "1"}})) == \
        step_digest(step_material(**{**base, "args": {"A": "1", "B": "2"}}))


def test_verify_expectations_are_in_the_digest_and_checked_at_load(tmp_path):
    from orchestrator.errors import InputError as IE
    from orchestrator.imagechain.spec import Verify
    from orchestrator import schema
    base = dict(kind="docker-build", chain="c", step="s", platform="linux/amd64", text="FROM x\n", args={},
                inputs=[], parent_id="sha256:p", uses={})
    def d(v):
        return step_digest(step_material(**base, extra={"verify": schema.to_dict(v)}))
    two = Verify(expect_lines=("VERIFY mxfp8: HIT", "VERIFY sparse_mla: HIT"))
    assert d(two) == d(Verify(expect_lines=("VERIFY mxfp8: HIT", "VERIFY sparse_mla: HIT")))
    assert d(two) != d(Verify(expect_lines=("VERIFY mxfp8: HIT",)))
    assert d(two) != d(Verify(expect="HIT/HIT"))
    for bad in ({"expect": "x", "expect_lines": ["y"]}, {}, {"expect_lines": [" "]}):
        with pytest.raises(IE, match="exactly one of expect"):
            schema.from_dict(Verify, bad, "verify", "f.yml")


def test_hash_tree_sees_content_names_and_exec_bits_but_not_mtimes_or_excluded(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(MINI / "vllm", d)
    h = hash_tree(d, (".git", "__pycache__"))
    os.utime(d / "setup.py", (1, 1))
    assert hash_tree(d, (".git", "__pycache__")) == h
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert hash_tree(d, (".git", "__pycache__")) == h
    os.chmod(d / "setup.py", 0o755)
    h2 = hash_tree(d, (".git", "__pycache__"))
    assert h2 != h
    (d / "setup.py").rename(d / "setup2.py")
    assert hash_tree(d, (".git", "__pycache__")) not in (h, h2)


def test_upload_tar_ships_what_is_hashed(tmp_path):
    tb = TarBuilder()
    tb.add_tree(MINI / "vllm", "src/vllm", ("__pycache__",))
    tb.add_bytes("Dockerfile", b"FROM x\n")
    with tarfile.open(fileobj=tb.finish()) as tf:
        names = set(tf.getnames())
        assert {m.mtime for m in tf.getmembers()} == {946684800}
    assert "src/vllm/vllm/models/deepseek_v4_1/common/engram.py" in names and "Dockerfile" in names
    assert "src/vllm/setup.py" in names and not any("__pycache__" in n for n in names)


def _deployment(tmp_path: Path, sets: tuple[str, ...] = ()):
    from orchestrator.deployment import load_deployment
    inv = tmp_path / "inv.yml"
    hosts = "\n".join(f"    n{i}: {{ansible_host: 10.9.9.{i}, rank: {i - 1}, hardware: dgx-spark, "
                      f"nvme_dir: /tmp/n, model_cache: /tmp/m}}" for i in range(1, 5))
    inv.write_text(f"all:\n  vars:\n    recipe: deepseek-v41-flash-tp4\n    head: n1\n  hosts:\n{hosts}\n")
    return load_deployment(inv, None, sets)


def test_plan_lists_the_chain_steps_and_contacts_nothing(tmp_path):
    from orchestrator.runoptions import RunOptions
    from orchestrator.stages.build import plan
    (act,), note = plan(_deployment(tmp_path), RunOptions())
    assert note == "" and act.host == "n1" and act.op == "docker-build"
    assert [s["name"] for s in act.details["steps"]] == ["c-ext", "overlay1", "overlay3", "overlay4", "overlay5",
                                                          "patch"]
    assert act.details["steps"][1]["parent"] == "base" and act.details["steps"][2]["parent"] == "overlay1"
    assert "ssh://root@10.9.9.1:22" in act.api
    json.dumps(act.to_json())
    (act,), _ = plan(_deployment(tmp_path, ("engine.chain=test-double",)), RunOptions())
    assert act.details["steps"][-1]["name"] == "engine-double"
    acts, note = plan(_deployment(tmp_path, ("engine.chain=null",)), RunOptions())
    assert acts == [] and "engine.chain is not set" in note


def test_cli_bad_var_is_exit_2_before_any_engine(tmp_path):
    inv = tmp_path / "inv.yml"
    _deployment(tmp_path)
    p = subprocess.run([sys.executable, "-m", "orchestrator", "build", "-i", str(inv), "--local",
                        "--set", "engine.chain=test-double", "--var", "vllm_package=vllm"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "source checkout, not the Python package" in " ".join(p.stderr.split())   # rich wraps lines
