"""Releases without a cluster: numbering, no-op detection, which images stay pinned, the pin tag, the
--set values a rollback runs, the history file's round trip. On the cluster: tests/test_releases.py."""
from __future__ import annotations

import pytest

from orchestrator import releases as rel
from orchestrator.cli.rollback_flow import target_after_failure
from orchestrator.deployment import load_deployment
from orchestrator.runner import RunOutcome, StageOutcome
from orchestrator.paths import INVENTORIES_DIR


def _r(n: int, image: str = "sha256:" + "a" * 64, specs=None, **kw) -> rel.Release:
    return rel.Release(number=n, time=1_700_000_000 + n, image_id=image, image="vllm-dsv41:latest",
                       recipe="deepseek-v41-flash-tp4", specs=specs or {"spark1": "s1"}, **kw)


def test_numbering_and_no_op():
    h = [_r(1), _r(2, "sha256:" + "b" * 64)]
    assert rel.next_number(h) == 3 and rel.next_number([]) == 1
    assert rel.current(h).number == 2 and rel.previous(h).number == 1 and rel.previous(h[:1]) is None
    assert not rel.is_new(h, "sha256:" + "b" * 64, {"spark1": "s1"}), "same image and specs: no new release"
    assert rel.is_new(h, "sha256:" + "b" * 64, {"spark1": "s2"}), "a spec changed"
    assert rel.is_new(h, "sha256:" + "c" * 64, {"spark1": "s1"}), "the image changed"
    assert rel.is_new([], "sha256:" + "b" * 64, {})


def test_one_image_under_each_image_stores_own_id():
    """A cluster mixing image stores runs one image under two IDs (manifest digest on the containerd
    store, config digest elsewhere): the release keeps each host's, pins with it, and compares them."""
    cd, cfg = "sha256:" + "d" * 64, "sha256:" + "c" * 64
    ids = {"spark1": cd, "spark2": cfg}
    r = _r(1, cd, specs={"spark1": "s1", "spark2": "s2"}, image_ids=ids)
    assert r.image_on("spark2") == cfg and r.image_on("spark1") == cd and _r(2).image_on("spark2") == _r(2).image_id
    assert rel.parse(rel.dump("spark4", [r])) == [r]
    assert "image_ids" not in _r(2).to_json()                      # a one-store cluster's record is unchanged
    assert not rel.is_new([r], cd, {"spark1": "s1", "spark2": "s2"}, ids)
    assert rel.is_new([r], cd, {"spark1": "s1", "spark2": "s2"}, {**ids, "spark2": "sha256:" + "e" * 64})


def test_the_last_k_are_kept_and_older_released():
    h = [_r(n) for n in range(1, 6)]
    assert [r.number for r in rel.kept(h, 3)] == [3, 4, 5]
    assert [r.number for r in rel.released(h, 3)] == [1, 2]
    assert [r.number for r in rel.kept(h[:2], 3)] == [1, 2] and rel.released(h[:2], 3) == []


def test_pin_tag_is_a_docker_reference_owned_by_deployctl():
    assert rel.pin_tag("spark4", 7) == "deployctl-release/spark4:7"
    assert rel.pin_tag("My_Dep", 1) == "deployctl-release/my_dep:1"


def test_rollback_sets_end_with_the_pin():
    r = _r(2, overrides=("engine.image=vllm-dsv41:latest", "engine.args.max-model-len=4096"))
    assert rel.rollback_sets("spark4", r) == ("engine.image=vllm-dsv41:latest", "engine.args.max-model-len=4096",
                                              "engine.image=deployctl-release/spark4:2")
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, rel.rollback_sets("spark4", r))
    assert dep.recipe.engine.image == "deployctl-release/spark4:2", "the last --set wins: the pinned image ID"


def test_history_round_trip_and_path():
    h = [_r(1, tables={"spark1": {"engram": "d1"}}, run_dir="runs/x", command="up"),
         _r(2, rollback_of=1, command="rollback")]
    assert rel.parse(rel.dump("spark4", h)) == h
    assert rel.parse(None) == []
    with pytest.raises(ValueError):
        rel.parse({"format": "something else"})
    assert rel.history_path("/mnt/nvme/deployctl", "spark4") == "/mnt/nvme/deployctl/.deployctl/releases/spark4.json"
    assert "rollback of 1" in h[1].describe()


def test_keep_is_a_recipe_setting():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    assert dep.recipe.releases.keep == 3
    assert load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("releases.keep=5",)).recipe.releases.keep == 5


@pytest.mark.parametrize("stages, why", [
    ([StageOutcome("ship", "failed")], "not in launch or health"),
    ([StageOutcome("launch", "skipped"), StageOutcome("health", "failed")], "launched nothing new"),
])
def test_no_rollback_when_the_failed_run_replaced_nothing(stages, why):
    """Decided before any host is contacted (the inventory's hosts do not exist here)."""
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    target, reason = target_after_failure(dep, RunOutcome("runs/x", "failed", 1, stages))
    assert target is None and why in reason


def test_secret_overrides_are_never_recorded_and_must_be_given_again():
    from orchestrator.secrets import mask_override
    r = _r(3, overrides=tuple(mask_override(o) for o in ("engine.env.HF_TOKEN=hf_abcdefgh1234", "engine.port=8001")))
    assert r.overrides == ("engine.env.HF_TOKEN=***", "engine.port=8001")
    assert rel.masked_overrides(r) == ("engine.env.HF_TOKEN=***",)
    assert rel.rollback_sets("spark4", r, ("engine.env.HF_TOKEN=hf_x",)) == (
        "engine.port=8001", "engine.env.HF_TOKEN=hf_x", "engine.image=deployctl-release/spark4:3")


def test_holder_container_name():
    assert rel.holder_name("spark4", 3) == "deployctl-pin-spark4-3"


COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def test_a_release_records_its_checkpoint_and_a_rollback_pins_that_commit():
    """#38: the release names the commit it served; rollback pins it (a branch that moved since is
    never resolved again), before the image pin; the commit's deployment mounts snapshots/<commit>."""
    ck = rel.checkpoint_of("deepseek-ai/DeepSeek-V4.1-Flash", "main", COMMIT_A, "", "m" * 64)
    assert ck == {"repo": "deepseek-ai/DeepSeek-V4.1-Flash", "revision": "main", "commit": COMMIT_A,
                  "manifest": "m" * 64}
    r = _r(3, overrides=("engine.args.max-model-len=4096",), checkpoint=ck)
    assert rel.parse(rel.dump("spark4", [r])) == [r], "the history file keeps it"
    assert "deepseek-ai/DeepSeek-V4.1-Flash@aaaaaaaaaaaa (manifest mmmmmmmmmmmm)" in r.describe()
    sets = rel.rollback_sets("spark4", r)
    assert sets == ("engine.args.max-model-len=4096", f"model.revision={COMMIT_A}",
                    "engine.image=deployctl-release/spark4:3")
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, sets)
    assert dep.recipe.model.revision == COMMIT_A and dep.snapshot == COMMIT_A
    assert dep.checkpoint_dir(dep.cluster.head_host).endswith(f"/snapshots/{COMMIT_A}")
    # a release from before checkpoints were recorded, or of a plain folder: no revision pinned
    assert rel.rollback_sets("spark4", _r(4))[-1] == "engine.image=deployctl-release/spark4:4"
    folder = rel.checkpoint_of("x/y", "main", "", "my-ckpt", "")
    assert folder == {"dir": "my-ckpt", "manifest": ""} and not any(
        s.startswith("model.revision") for s in rel.rollback_sets("spark4", _r(5, checkpoint=folder)))
    assert rel.Release.from_json({k: v for k, v in _r(6).to_json().items() if k != "checkpoint"}).checkpoint == {}


def test_a_run_without_sync_model_takes_the_manifest_of_the_same_commit():
    old = _r(1, checkpoint=rel.checkpoint_of("x/y", "main", COMMIT_A, "", "m1"))
    newer = _r(2, checkpoint=rel.checkpoint_of("x/y", "main", COMMIT_B, "", "m2"))
    assert rel.with_manifest(rel.checkpoint_of("x/y", COMMIT_A, COMMIT_A, "", ""), [old, newer])["manifest"] == "m1"
    assert rel.with_manifest(rel.checkpoint_of("x/y", "main", "c" * 40, "", ""), [old, newer])["manifest"] == "", \
        "a commit no release verified: none"
    assert rel.with_manifest(rel.checkpoint_of("x/y", "main", COMMIT_A, "", "m9"), [old])["manifest"] == "m9"


def test_served_checkpoint_reads_the_sync_model_digest():
    from orchestrator.cli.rollback_flow import served_checkpoint
    from orchestrator.outcomes import HostResult
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    sync = StageOutcome("sync-model", "ok", [HostResult(h, "sync-model", "ok", "", data={"manifest_digest": "d1"})
                                             for h in ("spark2", "spark3")])
    got = served_checkpoint(dep, RunOutcome("r", "ok", 0, [sync]))
    assert got == {"repo": dep.recipe.model.repo, "revision": "main", "commit": "", "manifest": "d1"}, \
        "a branch never resolved is no commit"
    import dataclasses
    from orchestrator.modelfetch.resolved import Resolved
    resolved = dataclasses.replace(dep, checkpoint=Resolved(COMMIT_B, "main", "cache"))
    assert served_checkpoint(resolved, RunOutcome("r", "ok", 0, [sync]))["commit"] == COMMIT_B
    assert served_checkpoint(dep, RunOutcome("r", "ok", 0, []))["manifest"] == ""
