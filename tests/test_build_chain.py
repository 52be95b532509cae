"""The miniature image chain (dockerfiles/chains/test-double.yml) against the real local Docker engine:
a full build, a no-op rebuild, a patch-only rebuild, and the checks that catch real mistakes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.executors import docker_engine as de
from orchestrator.imagechain import lock as locks
from orchestrator.imagechain.builder import CACHE_REPO, BuildReport, ChainBuilder, ChainFailed
from orchestrator.imagechain.spec import CHAINS_DIR, check_inputs, load_chain
from orchestrator.paths import ROOT
from orchestrator.runrecord import HostLog

pytestmark = pytest.mark.docker

MINI = ROOT / "tests" / "fixtures" / "mini-vllm"
IMAGE = "dctl-engine:test"
STEPS = ["nightly", "c-ext", "overlay1", "overlay3", "overlay4", "overlay5", "patch", "engine-double"]
BELOW_PATCH = STEPS[:STEPS.index("patch")]
SITE = "/usr/local/lib/python3.11/dist-packages"
ABOVE_PATCH = ["engine-double"]          # the test chain installs the engine double on the patch layer


def build(client, logs: Path, *, tag: str = IMAGE, inputs_dir: Path | None = None,
          variables: dict[str, str] | None = None, no_cache: bool = False,
          prune: bool = False) -> tuple[BuildReport, ChainBuilder]:
    chain = load_chain("test-double", inputs_dir=str(inputs_dir) if inputs_dir else None,
                       var_overrides=variables)
    check_inputs(chain)
    logs.mkdir(parents=True, exist_ok=True)
    b = ChainBuilder(client, chain, final_tag=tag, where="local engine", no_cache=no_cache,
                     log_for=lambda step: HostLog(logs / f"{step}.log", []))
    report = b.build()
    if prune:
        report.pruned = b.prune()
    return report, b


def run_in(image: str, script: str) -> str:
    p = subprocess.run(["docker", "run", "--rm", image, "sh", "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def status(report: BuildReport) -> dict[str, str]:
    return {s.name: s.status for s in report.steps}


def mini_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "inputs"
    shutil.copytree(MINI, dst)
    return dst


@pytest.fixture(scope="module")
def full(base_images, docker_client, tmp_path_factory):
    """A real full build (no cache at all), then at the end a build with --prune: the variants the
    tests made are stale and go."""
    logs = tmp_path_factory.mktemp("full")
    t0 = time.monotonic()
    report, _ = build(docker_client, logs, no_cache=True)
    yield report, time.monotonic() - t0
    final, _ = build(docker_client, tmp_path_factory.mktemp("prune"), prune=True)
    assert final.status == "ok"


def test_full_build_makes_a_serving_image_for_vllm_and_sglang(full):
    report, _ = full
    assert status(report) == {s: "built" for s in STEPS}
    assert report.status == "ok" and report.image == IMAGE
    out = run_in(IMAGE, "vllm --version; python3 -c 'import sglang.launch_server; print(\"sglang ok\")'; "
                        "python3 -c 'import vllm, os, flashinfer; import vllm.models.deepseek_v4_1.common.engram as e; "
                        "import vllm.v1.attention.backends.mla.sparse_swa as s; d = os.path.dirname(vllm.__file__); "
                        "print(e.PATCHED, s.PATCHED, sorted(f for f in os.listdir(d) if f.endswith(\".so\")), "
                        "flashinfer.__git_ref__)'; test ! -e /usr/local/lib/python3.11/dist-packages/vllm/setup.py")
    assert "0.1.0-engine-double" in out and "sglang ok" in out
    assert "True True ['_C_stable_libtorch.abi3.so', '_moe_C_stable_libtorch.abi3.so'] 07869c61" in out
    attrs = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, text=True).stdout
    labels = json.loads(attrs)[0]["Config"]["Labels"]
    assert labels["deployctl.chain"] == "test-double" and labels["deployctl.step"] == "engine-double"
    assert labels["deployctl.digest"] == report.steps[-1].digest
    for s in report.steps:   # every step's log has its build output
        assert Path(s.log).read_text().strip()


def test_noop_rebuild_reuses_every_step_in_seconds(full, docker_client, tmp_path):
    report, full_s = full
    t0 = time.monotonic()
    again, _ = build(docker_client, tmp_path)
    took = time.monotonic() - t0
    assert status(again) == {s: "reused" for s in STEPS}
    assert [s.digest for s in again.steps] == [s.digest for s in report.steps]
    assert again.image_id == report.image_id and not again.tag_changed
    assert took < 3.0, f"no-op rebuild took {took:.1f}s (full build {full_s:.1f}s)"


def test_patch_change_rebuilds_only_the_patch_layer(full, docker_client, tmp_path):
    report, _ = full
    inputs = mini_copy(tmp_path)
    (inputs / "patch" / "attention.py").write_text('PATCHED = True\nNAME = "attention"\nPAGE = 64\n')
    tag = "dctl-engine:test-patch-change"
    try:
        again, _ = build(docker_client, tmp_path / "logs", tag=tag, inputs_dir=inputs)
        n = len(BELOW_PATCH)
        assert status(again) == {**{s: "reused" for s in BELOW_PATCH}, "patch": "built",
                                 **{s: "built" for s in ABOVE_PATCH}}
        assert [s.digest for s in again.steps[:n]] == [s.digest for s in report.steps[:n]]
        out = run_in(tag, "python3 -c 'import vllm.models.deepseek_v4_1.attention as a; print(a.PAGE)'")
        assert out.strip() == "64"
    finally:
        de.remove_image(docker_client, tag)


def test_moved_patch_destination_fails_naming_the_patch_and_path(full, docker_client, tmp_path):
    inputs = mini_copy(tmp_path)
    pkg = inputs / "vllm" / "vllm" / "models" / "deepseek_v4_1"
    (pkg / "attention.py").rename(pkg / "attention_sm121.py")       # upstream moved the module
    with pytest.raises(ChainFailed) as e:
        build(docker_client, tmp_path / "logs", tag="dctl-engine:test-moved", inputs_dir=inputs)
    f = e.value
    assert f.step == "patch"
    msg = str(f)
    assert "patch 4 (attention.py)" in msg
    assert "/usr/local/lib/python3.11/dist-packages/vllm/models/deepseek_v4_1/attention.py does not exist" in msg
    assert "image below (overlay5" in msg
    st = status(f.report)
    assert st["overlay1"] == "built" and st["patch"] == "failed" and st["engine-double"] == "not-run"
    assert de.image_id(docker_client, "dctl-engine:test-moved") is None


def test_failed_verification_fails_with_the_log_tail_and_leaves_no_image(full, docker_client, tmp_path):
    with pytest.raises(ChainFailed) as e:
        build(docker_client, tmp_path / "logs", tag="dctl-engine:test-unverified",
              variables={"sparse_mla_prebuild": "0"})
    f = e.value
    assert f.step == "overlay5"
    msg = str(f)
    assert "verification failed" in msg
    # the MISS line is named, the HIT line is not a problem
    assert "VERIFY sparse_mla did not pass: 'VERIFY sparse_mla: MISS-COMPILED 20.0s'" in msg
    assert "need a line starting 'VERIFY sparse_mla: HIT'" in msg and "mxfp8" not in msg.split("`: ", 1)[1]
    assert "VERIFY mxfp8: HIT 0.0s (is_compiled=True)" in f.tail
    assert "VERIFY sparse_mla: MISS-COMPILED 20.0s" in f.tail
    st = status(f.report)
    below = STEPS[:STEPS.index("overlay5")]
    assert [st[s] for s in below] == ["reused"] * len(below) and st["overlay5"] == "failed"
    digest = f.report.steps[STEPS.index("overlay5")].digest
    ref = f"{CACHE_REPO}/test-double:overlay5-{digest.split(':')[1]}"
    assert de.image_id(docker_client, ref) is None       # a failed verification is never cached
    # and the same build fails again (it is not reused)
    with pytest.raises(ChainFailed):
        build(docker_client, tmp_path / "logs2", tag="dctl-engine:test-unverified",
              variables={"sparse_mla_prebuild": "0"})


def test_run_copy_out_output_missing_is_named(full, docker_client, tmp_path):
    inputs = mini_copy(tmp_path)
    script = inputs / "build" / "build_stable_ext.sh"
    script.write_text(script.read_text().replace("_moe_C_stable_libtorch; do", "; do"))
    with pytest.raises(ChainFailed) as e:
        build(docker_client, tmp_path / "logs", tag="dctl-engine:test-noext", inputs_dir=inputs)
    assert e.value.step == "c-ext" and "exited 1" in str(e.value)
    assert any("no file matches output pattern vllm/vllm/_moe_C_stable_libtorch*.so" in t for t in e.value.tail)


def test_update_lock_without_registry_pins_the_local_image_id(full, docker_client, tmp_path):
    for name in ("test-double.yml", "test-double.lock.yml"):
        shutil.copy(CHAINS_DIR / name, tmp_path / name)
    chain = load_chain(str(tmp_path / "test-double.yml"), inputs_dir=str(MINI),
                       input_roots={"engine_double": str(ROOT / "tests" / "engine_double")})
    base, msg = locks.resolve_base(docker_client, chain.lock.base)
    assert base.source == "local-only" and base.digest is None
    assert base.image_id == de.image_id(docker_client, "dctl-debian:bookworm")
    assert "no registry reachable" in msg and "upstream changes cannot be detected" in msg
    chain = locks.write_lock(chain, base)
    text = (tmp_path / "test-double.lock.yml").read_text()
    assert text.startswith("# Lock of the test-double chain") and f"image_id: {base.image_id}" in text
    again = load_chain(str(tmp_path / "test-double.yml"), inputs_dir=str(MINI),
                       input_roots={"engine_double": str(ROOT / "tests" / "engine_double")})
    assert again.lock.base == base
    base2, _ = locks.resolve_base(docker_client, again.lock.base)      # nothing moved: file left alone
    assert not locks.pin_changed(base, base2)
    mtime = (tmp_path / "test-double.lock.yml").stat().st_mtime_ns
    locks.write_lock(again, base2)
    assert (tmp_path / "test-double.lock.yml").stat().st_mtime_ns == mtime
    # a pinned digest the engine does not have and cannot pull: a clear failure, nothing built
    pinned = locks.write_lock(again, base.__class__(**{**base.__dict__, "digest": "sha256:" + "0" * 64}))
    b = ChainBuilder(docker_client, pinned, final_tag="dctl-engine:test-pinned", where="local engine",
                     log_for=lambda s: HostLog(tmp_path / f"{s}.log", []))
    with pytest.raises(ChainFailed) as e:
        b.build()
    assert e.value.step == "base" and "could not be pulled" in str(e.value)
    assert "dctl-debian@sha256:000" in str(e.value)


def test_cli_ci_json_report_and_prune(full, tmp_path):
    inv = tmp_path / "inv.yml"
    hosts = "\n".join(f"    n{i}: {{ansible_host: 10.9.9.{i}, rank: {i - 1}, hardware: dgx-spark, "
                      f"nvme_dir: /tmp/n, model_cache: /tmp/m}}" for i in range(1, 5))
    # hosts of this machine's architecture (as the test cluster's): the image is built for the head's
    inv.write_text(f"all:\n  vars:\n    recipe: deepseek-v41-flash-tp4\n    head: n1\n    run_dir: {tmp_path}/runs\n"
                   f"    expect_arch: x86_64\n  hosts:\n{hosts}\n")
    summary = tmp_path / "summary.md"
    p = subprocess.run([sys.executable, "-m", "orchestrator", "build", "-i", str(inv), "--local", "--ci", "--json",
                        "--set", "engine.chain=test-double", "--set", f"engine.image={IMAGE}"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "GITHUB_STEP_SUMMARY": str(summary)})
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    (res,) = doc["stages"][0]["results"]
    rep = res["data"]["report"]
    assert res["status"] == "skipped" and "up to date" in res["message"]
    assert [s["status"] for s in rep["steps"]] == ["reused"] * len(STEPS)
    assert all(s["digest"].startswith("sha256:") and s["image_id"] and "seconds" in s and s["log"]
               for s in rep["steps"])
    on_disk = json.loads((Path(doc["run_dir"]) / "build-report.json").read_text())
    assert on_disk["image_id"] == rep["image_id"]
    assert "| overlay5 | docker-build | reused |" in summary.read_text()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "build", "-i", str(inv), "--local", "--prune",
                        "--set", "engine.chain=test-double", "--set", f"engine.image={IMAGE}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "overlay5: reused" in p.stderr and "prune: removed" in p.stderr   # one line per step
    assert "Step 1/" not in p.stderr                                            # the output is in the logs
    # a failing build: exit 1, the failed step, its log and tail
    p = subprocess.run([sys.executable, "-m", "orchestrator", "build", "-i", str(inv), "--local", "--ci", "--json",
                        "--set", "engine.chain=test-double", "--set", "engine.image=dctl-engine:test-cli-fail",
                        "--var", "sparse_mla_prebuild=0"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    (res,) = json.loads(p.stdout)["stages"][0]["results"]
    assert res["status"] == "failed" and "step overlay5" in res["message"]
    assert res["log"].endswith("build-overlay5.log") and "VERIFY sparse_mla: MISS-COMPILED 20.0s" in res["tail"]
    assert "VERIFY sparse_mla: MISS-COMPILED" in p.stderr       # describe_failure shows the tail


def test_overlay1_purges_bytecode_and_overlay3_removes_the_stale_flashinfer_packages(full):
    # the nightly stand-in shipped vllm/__pycache__/stale_nightly...pyc and FlashInfer 0.6.18 as three
    # pip packages (flashinfer-python, flashinfer-jit-cache, flashinfer-cubin)
    out = run_in(IMAGE, f"ls {SITE}; echo ---; ls {SITE}/vllm/__pycache__; echo ---; "
                        "python3 -c 'import flashinfer; print(flashinfer.__version__)'")
    site, pycache, fi = out.split("---\n")
    assert "flashinfer_python-0.7.0rc1.dist-info" in site.split()
    stale = [d for d in site.split() if d.startswith(("flashinfer_jit_cache", "flashinfer_cubin"))
             or d.startswith("flashinfer_python-0.6.18")]
    assert stale == [], stale
    assert "stale_nightly.cpython-311.pyc" not in pycache      # purged; `import vllm` recompiled __init__
    assert fi.strip() == "0.7.0rc1"
    logs = {s.name: Path(s.log).read_text() for s in full[0].steps}
    for dist in ("flashinfer_jit_cache", "flashinfer_cubin", "flashinfer_python"):
        assert f"uninstalling {dist}-0.6.18.dist-info" in logs["overlay3"]
    assert "0.0.0+mini.e47aa780b" in logs["overlay1"]          # the import check printed the version
    assert "BUILD OK" in logs["c-ext"]


def test_max_jobs_reaches_the_prebuild_and_the_verification(full):
    out = run_in(IMAGE, "cat /root/.cache/flashinfer/0.7.0rc1/121a/cached_ops/*/build.txt")
    assert "mxfp8_gemm_cutlass_sm120 built with MAX_JOBS=2 FLASHINFER_NVCC_THREADS=1" in out
    assert "prebuilt MAX_JOBS=4" in out                         # build_overlay5.sh's prewarm
    log = Path(full[0].steps[STEPS.index("overlay5")].log).read_text()
    assert "verify: MAX_JOBS=2" in log and "VERIFY mxfp8: HIT" in log and "VERIFY sparse_mla: HIT" in log
    assert "verify: found lines 'VERIFY mxfp8: HIT', 'VERIFY sparse_mla: HIT'" in log


def test_verify_needs_every_line_at_the_start_of_a_line():
    from orchestrator.imagechain.spec import Verify
    v = Verify(expect_lines=("VERIFY mxfp8: HIT", "VERIFY sparse_mla: HIT"))
    ok = "noise\nVERIFY mxfp8: HIT 1.5s (is_compiled=True)\n  VERIFY sparse_mla: HIT 0.0s\n"
    assert v.check(ok) == []
    (p,) = v.check("VERIFY mxfp8: HIT 1.5s (is_compiled=True)\nVERIFY sparse_mla: MISS-COMPILED 41.2s\n")
    assert p.startswith("VERIFY sparse_mla did not pass: 'VERIFY sparse_mla: MISS-COMPILED 41.2s'")
    (p,) = v.check("VERIFY mxfp8: MISS 1.4s (is_compiled=True, RuntimeError: x)\nVERIFY sparse_mla: HIT 0.0s\n")
    assert "VERIFY mxfp8 did not pass" in p
    # one combined line is not what verify5.py prints: sparse_mla is missing from the start of a line
    (p,) = v.check("VERIFY mxfp8: HIT 1.5s VERIFY sparse_mla: HIT 0.0s\n")
    assert "sparse_mla" in p and "no line starting 'VERIFY sparse_mla: HIT'" in p
    assert len(v.check("sparse_mla HIT/HIT\n")) == 2
    assert len(v.check("")) == 2
