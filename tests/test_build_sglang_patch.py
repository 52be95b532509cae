"""The sglang-qwen38 chain's patch layer (deployctl_sglang_ple) on the real local Docker engine, over
a stand-in of the SGLang image: a Debian python3 image with an `sglang` distribution of a given
version and the upstream module files the patch builds on (empty: only their presence is checked).
What is tested is deployctl's chain machinery: the added package lands beside sglang, and the build
refuses another sglang version or a base where the modules it builds on moved."""
from __future__ import annotations

import io
import subprocess
import tarfile

import pytest
import yaml

from orchestrator.imagechain.builder import ChainBuilder, ChainFailed
from orchestrator.imagechain.spec import CHAINS_DIR, check_inputs, load_chain
from orchestrator.runrecord import HostLog

pytestmark = pytest.mark.docker

SITE = "/usr/local/lib/python3.11/dist-packages"
UPSTREAM = ["sglang/__init__.py", "sglang/srt/__init__.py", "sglang/srt/environ.py",
            "sglang/srt/models/__init__.py", "sglang/srt/models/registry.py",
            "sglang/srt/models/qwen4_exp.py", "sglang/srt/models/qwen4_exp_ple_table.py"]


def fake_sglang_base(client, tag: str, version: str, files=UPSTREAM) -> str:
    """FROM dctl-debian:bookworm + an sglang dist-info of `version` and the given module files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        mk = " && ".join(f"mkdir -p {SITE}/{f.rsplit('/', 1)[0]} && touch {SITE}/{f}" for f in files)
        add("Dockerfile", (f"FROM dctl-debian:bookworm\nRUN {mk} && mkdir -p {SITE}/sglang-{version}.dist-info "
                           f"&& printf 'Metadata-Version: 2.1\\nName: sglang\\nVersion: {version}\\n' "
                           f"> {SITE}/sglang-{version}.dist-info/METADATA\n").encode())
    buf.seek(0)
    client.images.build(fileobj=buf, custom_context=True, tag=tag, rm=True)
    return tag


def build(client, tmp_path, base: str, tag: str):
    lock = yaml.safe_load((CHAINS_DIR / "sglang-qwen38.lock.yml").read_text())
    lock["base"]["image"] = base
    lock["input_roots"] = {"sglang_patches": str(CHAINS_DIR.parent / "sglang-qwen38" / "patches")}
    lf = tmp_path / "sglang-qwen38.lock.yml"
    lf.write_text(yaml.safe_dump(lock))
    chain = load_chain("sglang-qwen38", lock_file=lf, var_overrides={"python_version": "3.11"})
    check_inputs(chain)
    (tmp_path / "logs").mkdir(exist_ok=True)
    b = ChainBuilder(client, chain, final_tag=tag, where="local engine", no_cache=True,
                     log_for=lambda step: HostLog(tmp_path / "logs" / f"{step}.log", []))
    return b.build()


def run(image: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "run", "--rm", image, *argv], capture_output=True, text=True, timeout=120)


def test_patch_package_lands_beside_sglang(base_images, docker_client, tmp_path):
    base = fake_sglang_base(docker_client, "dctl-fake-sglang:0.5.23", "0.5.23")
    build(docker_client, tmp_path, base, "dctl-sglang-patched:test")
    p = run("dctl-sglang-patched:test", "python3", "-c",
            "import deployctl_sglang_ple.prewritten as p, importlib.metadata as m; "
            "print(p.MANIFEST_SUFFIX, m.version('sglang'))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [".deployctl-manifest.json", "0.5.23"]
    p = run("dctl-sglang-patched:test", "ls", f"{SITE}/deployctl_sglang_ple")
    assert sorted(p.stdout.split()) == ["__init__.py", "prewritten.py", "qwen4_exp_prewritten.py"]
    log = (tmp_path / "logs" / "patch.log").read_text()
    assert f"requires {SITE}/sglang/srt/models/qwen4_exp.py: file" in log
    assert "(added)" in log


def test_another_sglang_version_is_refused(base_images, docker_client, tmp_path):
    base = fake_sglang_base(docker_client, "dctl-fake-sglang:0.5.24", "0.5.24")
    with pytest.raises(ChainFailed) as e:
        build(docker_client, tmp_path, base, "dctl-sglang-patched:wrong")
    assert "sglang 0.5.24" in str(e.value) + (tmp_path / "logs" / "patch.log").read_text()


def test_moved_upstream_module_is_named(base_images, docker_client, tmp_path):
    files = [f for f in UPSTREAM if not f.endswith("qwen4_exp_ple_table.py")]
    base = fake_sglang_base(docker_client, "dctl-fake-sglang:moved", "0.5.23", files)
    with pytest.raises(ChainFailed) as e:
        build(docker_client, tmp_path, base, "dctl-sglang-patched:moved")
    assert "builds on" in str(e.value) and "qwen4_exp_ple_table.py" in str(e.value)
