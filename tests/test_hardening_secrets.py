"""Issue #14, "Secrets leak": secret-named engine args and env values (any length, spaces included) are
masked in everything deployctl writes (console, plan text and JSON, dry runs, run records, status), and
the engines still get the real values. No cluster, no Docker."""
from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys

from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import runner, secrets
from orchestrator.deployment import load_deployment
from orchestrator.launch.containers import env_file, run_argv
from orchestrator.launch.containerspec import container_spec
from orchestrator.outcomes import HostFailure, run_per_host
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.plan import Plan, StagePlan
from orchestrator.runrecord import RunContext
from orchestrator.secrets import MASK, is_secret_name, mask_argv, mask_data, mask_text, register_named
from orchestrator.stages import build_plan
from orchestrator.stages.base import Stage

TOKEN = "hf_SECRETVALUE123"
SPACED = "a b c"
SETS = (f"engine.args.hf-token={TOKEN}", f"engine.env.MY_SECRET={SPACED}")
INV = str(INVENTORIES_DIR / "spark4.yml")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """Each test starts with no registered secrets (the registry is process-wide)."""
    monkeypatch.setattr(secrets, "_REGISTERED", set())


# ------------------------------------------------------------------------------------------ names

@pytest.mark.parametrize("name", [
    "hf-token", "HF_TOKEN", "api-key", "OPENAI_API_KEY", "apiKey", "apikey", "password", "DB_PASSWORD",
    "passwd", "DB_PASS", "MY_SECRET", "client-secret", "credentials", "auth", "auth-token", "oauth",
    "AWS_SECRET_ACCESS_KEY", "private-key", "ssl-keyfile-password", "engine.env.MY_SECRET", "--hf-token"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "max-tokens", "max-num-batched-tokens", "tokenizer", "tokenizer-mode", "ssl-keyfile", "HF_HOME",
    "HF_TOKEN_FILE", "api_key_id", "deployctl.api-key-id", "api_key_rotation", "SSH_AUTH_SOCK",
    "key_rejected", "table_key", "gpu-memory-utilization", "served-model-name", "-e", "--label",
    "model.kv_bytes_per_token", "ms_per_token"])
def test_ordinary_names(name):
    assert not is_secret_name(name)


# ------------------------------------------------------------------------------------------ argv

def test_mask_argv_forms():
    argv = ["vllm", "serve", "/model", "--hf-token", TOKEN, "--api-key=sk-1 2", "--enable-auth", "--port",
            "8000", "--password", "x", "-e", f"MY_SECRET={SPACED}", "-e", "OMP_NUM_THREADS=1",
            "--label", "deployctl.api-key-id=abc123", "--hf-overrides", '{"auth_token": "t0k"}']
    assert mask_argv(argv, []) == [
        "vllm", "serve", "/model", "--hf-token", MASK, f"--api-key={MASK}", "--enable-auth", "--port",
        "8000", "--password", MASK, "-e", f"MY_SECRET={MASK}", "-e", "OMP_NUM_THREADS=1",
        "--label", "deployctl.api-key-id=abc123", "--hf-overrides", f'{{"auth_token": "{MASK}"}}']


def test_ordinary_argv_is_unchanged():
    dep = load_deployment(INV)
    spec = container_spec(dep, dep.cluster.host("spark2"), None, None)
    argv = spec.docker_run_argv()
    assert mask_argv(argv, []) == argv
    assert mask_data(spec.to_json(), []) == json.loads(json.dumps(spec.to_json()))


# ------------------------------------------------------------------------------------------ text

@pytest.mark.parametrize("text, masked", [
    (f'MY_SECRET="{SPACED}" next', f"MY_SECRET={MASK} next"),
    (f"MY_SECRET='{SPACED}' next", f"MY_SECRET={MASK} next"),
    (f"-e 'MY_SECRET={SPACED}' -e X=1", f"-e 'MY_SECRET={MASK}' -e X=1"),        # shlex.join of -e NAME=V
    ("HF_TOKEN=abc rest", f"HF_TOKEN={MASK} rest"),
    (f"vllm serve --hf-token {TOKEN} --port 8000", f"vllm serve --hf-token {MASK} --port 8000"),
    (f"--hf-token={TOKEN} --enable-auth --port 8", f"--hf-token={MASK} --enable-auth --port 8"),
    ("--hf-token 'a b' x", f"--hf-token {MASK} x"),
    ("'--api-key=a b' y", f"'--api-key={MASK}' y"),
    ("non-default args: {'hf_token': 'hf_x', 'max_tokens': 5}",                   # vLLM's log
     f"non-default args: {{'hf_token': '{MASK}', 'max_tokens': 5}}"),
    ('{"api_key": "s\\"k", "port": 1}', f'{{"api_key": "{MASK}", "port": 1}}'),
    ("ServerArgs(model_path='/m', api_key='sk 1', port=30000)",                    # SGLang's log
     f"ServerArgs(model_path='/m', api_key={MASK}, port=30000)"),
])
def test_mask_text_by_name(text, masked):
    assert mask_text(text, []) == masked


def test_nothing_else_is_masked():
    text = ("vllm serve /model --max-tokens 50 --tokenizer deepseek --max-num-batched-tokens 8192 "
            "HF_HOME=/cache/huggingface api_key_id=0a1b2c deployctl.api-key-id=0a1b2c SSH_AUTH_SOCK=/tmp/a "
            '{"max_tokens": 8, "token_count": 3} --api-key: deployctl sets it')
    assert mask_text(text, []) == text


def test_registered_values_are_masked_whole_anywhere():
    register_named({"MY_SECRET": SPACED, "hf-token": TOKEN, "password": "abc",   # too short: by position only
                    "auth": True, "OMP_NUM_THREADS": "12345", "HF_TOKEN": "${HF_TOKEN}", "api-key": 12345678})
    assert set(secrets.secret_values({})) == {SPACED, TOKEN, "12345678"}
    line = f"engine echoed {SPACED} and {TOKEN}; abc, 12345 and 12345678"
    assert mask_text(line) == f"engine echoed {MASK} and {MASK}; abc, 12345 and {MASK}"


def test_mask_data():
    doc = {"overrides": [f"engine.args.hf-token={TOKEN}", f"engine.env.MY_SECRET={SPACED}", "model.x=1"],
           "env": {"MY_SECRET": SPACED, "N": "1"}, "args": {"hf-token": TOKEN, "password": 1234, "auth": True},
           "api_key_id": "0a1b2c", "command": ["x", "--hf-token", TOKEN]}
    assert mask_data(doc, []) == {
        "overrides": [f"engine.args.hf-token={MASK}", f"engine.env.MY_SECRET={MASK}", "model.x=1"],
        "env": {"MY_SECRET": MASK, "N": "1"}, "args": {"hf-token": MASK, "password": MASK, "auth": True},
        "api_key_id": "0a1b2c", "command": ["x", "--hf-token", MASK]}


# ------------------------------------------------------------------------------------------ real values for the engine

def test_launch_passes_the_real_values_and_the_plan_masks_them():
    dep = load_deployment(INV, None, SETS)
    assert set(secrets.secret_values({})) >= {TOKEN, SPACED}, "registered when the deployment loads"
    spec = container_spec(dep, dep.cluster.host("spark1"), None, None)
    argv = run_argv(spec, "unix:///var/run/docker.sock")
    assert argv[argv.index("--hf-token") + 1] == TOKEN
    # a secret-named variable goes through --env-file /dev/stdin, never on the host's command line
    assert "--env-file" in argv and not any("MY_SECRET" in a for a in argv)
    assert env_file({"MY_SECRET": SPACED}) == f"MY_SECRET={SPACED}\n"
    plan = build_plan(dep, ("launch",))
    (action, *_) = plan.stage("launch").actions
    assert TOKEN in action.command and action.job.env["MY_SECRET"] == SPACED, "the plan's jobs keep them"
    text = json.dumps(plan.to_json())
    assert TOKEN not in text and SPACED not in text and f"MY_SECRET={MASK}" in text


def test_expanded_env_is_registered_when_launch_starts(monkeypatch, tmp_path):
    """launch expands ${VAR}s of secret-named variables: those values are masked from then on."""
    from orchestrator.launch import launcher

    def no_hosts(*a, **k):
        raise RuntimeError("stop before any host")
    dep = load_deployment(INV, None, ("engine.env.MY_PASSWORD=${DCTL_TEST_PW}",))
    assert secrets.secret_values({}) == [], "a ${VAR} reference is not a secret"
    monkeypatch.setenv("DCTL_TEST_PW", "pw with spaces")
    monkeypatch.setattr(launcher, "run_shells", no_hosts)
    ctx = RunContext(tmp_path / "run")
    with pytest.raises(RuntimeError, match="stop before any host"):
        launcher.apply(dep, [], ctx)
    ctx.close()
    assert secrets.secret_values({}) == ["pw with spaces"]


# ------------------------------------------------------------------------------------------ run records

def test_run_records_are_masked(tmp_path):
    dep = load_deployment(INV, None, SETS)
    spec = container_spec(dep, dep.cluster.host("spark1"), None, None)

    def apply(d, actions, ctx):
        def one(action, log):
            log.write(f"launching: {shlex.join(spec.docker_run_argv())}")
            log.write(f"launching: {' '.join(spec.docker_run_argv())}")
            log.write(f"engine: MY_SECRET='{SPACED}' hf_token={TOKEN} {{'hf_token': '{TOKEN}'}}")
            ctx.event("docker-run", host=action.host, argv=list(spec.argv), env=spec.env)
            if action.host == "spark2":
                raise HostFailure(f"docker run failed: unknown flag --hf-token {TOKEN} ({SPACED})", rc=1,
                                  tail=[f"MY_SECRET={SPACED}"])
            return "started"
        return run_per_host(actions, ctx, one)

    launch = Stage("launch", lambda d, o: ([], ""), apply)
    planned = build_plan(dep, ("launch",)).stage("launch")
    plan = Plan(dep, (StagePlan("launch", planned.actions, stage=launch),))
    ctx = RunContext(tmp_path / "run")
    out = runner.run(plan, ctx, "up")
    ctx.close()
    assert out.exit_code == 1
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"plan.json", "events.jsonl", "status.json", "launch.log"}
    for p in files:
        text = p.read_text()
        assert TOKEN not in text and SPACED not in text, p
    log = (tmp_path / "run" / "logs" / "spark1" / "launch.log").read_text()
    assert f"--hf-token {MASK}" in log and f"MY_SECRET={MASK}" in log
    plan_doc = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan_doc["recipe"]["overrides"] == [f"engine.args.hf-token={MASK}", f"engine.env.MY_SECRET={MASK}"]
    # what the CLI prints about the failure goes through the masking console
    from orchestrator.cli.common import MaskingConsole
    shown = io.StringIO()
    MaskingConsole(file=shown, width=500).print(runner.describe_failure(out.failures[0]), markup=False)
    assert "spark2: stage launch failed" in shown.getvalue()
    assert TOKEN not in shown.getvalue() and SPACED not in shown.getvalue()


def test_host_log_masks_secrets_registered_after_the_run_started(tmp_path):
    ctx = RunContext(tmp_path / "run")
    log = ctx.host_log("spark1", "launch")
    secrets.register_secret("late secret value")
    log.write("the engine said: late secret value")
    ctx.event("x", text="late secret value")
    ctx.close()
    log.close()
    assert "late secret value" not in (tmp_path / "run" / "logs" / "spark1" / "launch.log").read_text()
    assert "late secret value" not in (tmp_path / "run" / "events.jsonl").read_text()


# ------------------------------------------------------------------------------------------ the CLI

def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "MY_SECRET")}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def sets(*exprs: str) -> list[str]:
    return [a for e in exprs for a in ("--set", e)]


@pytest.mark.parametrize("command", [["plan"], ["plan", "--json"], ["plan", "-v"], ["up", "--dry-run"],
                                     ["up", "--dry-run", "--json"], ["launch", "--dry-run"]])
def test_cli_plans_never_show_the_secrets(command, tmp_path):
    p = cli(*command, "-i", INV, *sets(*SETS))
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert TOKEN not in out and SPACED not in out
    assert f"hf-token={MASK}" in out and f"MY_SECRET={MASK}" in out
    if "--json" in command:
        doc = json.loads(p.stdout)
        (launch,) = [s for s in doc["stages"] if s["name"] == "launch"]
        for a in launch["actions"]:
            assert a["command"][a["command"].index("--hf-token") + 1] == MASK
            assert a["details"]["container"]["env"]["MY_SECRET"] == MASK
    else:
        assert f"--hf-token '{MASK}'" in out                 # shlex quotes the mask


def test_cli_refusal_and_type_errors_never_show_the_secret():
    p = cli("plan", "-i", INV, *sets("engine.args.api-key=sk-SECRETKEY999"))
    assert p.returncode == 2 and "sk-SECRETKEY999" not in p.stdout + p.stderr
    assert "--api-key: deployctl sets it from the inventory's api_key_file" in p.stderr
    p = cli("plan", "-i", INV, *sets("engine.env.HF_TOKEN={a: sk-SECRETKEY999}"))
    assert p.returncode == 2 and "sk-SECRETKEY999" not in p.stdout + p.stderr
    assert "engine.env.HF_TOKEN: expected a string" in p.stderr


def test_plan_and_dry_run_write_no_run_record(tmp_path):
    """plan (without --check) and up --dry-run contact no host and write nothing (no runs/ to mask)."""
    for command in (["plan"], ["up", "--dry-run"]):
        p = subprocess.run([sys.executable, "-m", "orchestrator", *command, "-i", INV, *sets(*SETS)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert p.returncode == 0, p.stderr
        assert not any(tmp_path.rglob("*")), "nothing written"


def test_status_output_is_masked(monkeypatch):
    from orchestrator.cli.status_cmd import status_command
    from orchestrator.launch import lifecycle
    doc = {"deployment": "spark4", "recipe": "r", "image": "img",
           "api": {"url": "http://x:8000", "healthy": False, "detail": f"refused --hf-token {TOKEN}",
                   "key_rejected": False, "api_key_id": "0a1b2c"},
           "hosts": [{"host": "spark1", "rank": 0, "reachable": False,
                      "error": f"docker: MY_SECRET='{SPACED}' --api-key={TOKEN}"}]}
    monkeypatch.setattr(lifecycle, "cluster_status", lambda dep: doc)
    for extra in ([], ["--json"]):
        r = CliRunner().invoke(status_command, ["-i", INV, *sets(*SETS), *extra])
        assert TOKEN not in r.output and SPACED not in r.output, r.output
        assert MASK in r.output and "0a1b2c" in r.output, "a key id is not a secret"
