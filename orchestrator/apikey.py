"""The serving API key: a secret the inventory points at, never a value in a recipe, an argv, a plan, a
run record, a log or `docker inspect`'s command line.

The inventory names where it is: `api_key_file` (a file on the controller) or `api_key_env` (an
environment variable on the controller). deployctl reads it when it loads the deployment, registers it
with secrets.py (so any accidental occurrence is masked), and:
- hands it to the engine without argv: vLLM reads VLLM_API_KEY (vllm/envs.py; vllm/entrypoints/serve/
  middleware/register.py installs AuthenticationMiddleware when it is set), passed with the engine's
  other secret variables through `docker run --env-file /dev/stdin` (launch/containers.py run_argv).
  SGLang 0.5.23 has no environment variable for it (sglang/srt/server_args.py takes `--api-key` only),
  so it reads a YAML file mounted read-only through its own `--config` (sglang/srt/utils/
  server_args_config_parser.py ConfigArgumentMerger): launch writes `api-key: <key>` there, mode 0600;
- sends `Authorization: Bearer <key>` from every probe (health, status, launch's no-op check, bench);
- puts `key_id` (a salted sha256 prefix, not the key) into the launch spec digest and a container label,
  so a changed key relaunches the engines and `plan` can say which key a deployment runs with.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError
from .secrets import register_secret

if TYPE_CHECKING:
    from .inventory import Cluster

ENV_NAME = "DEPLOYCTL_API_KEY"        # launch expands ${DEPLOYCTL_API_KEY} in the engine env from the key
VLLM_ENV = "VLLM_API_KEY"             # vllm/envs.py
SGLANG_CONFIG = "/run/deployctl/sglang-api-key.yaml"   # where the SGLang --config file is mounted
LABEL = "deployctl.api-key-id"
MIN_LENGTH = 8


@dataclass(frozen=True)
class ApiKey:
    value: str = field(repr=False)
    source: str                       # for people: "file /path" or "environment variable NAME"

    @property
    def key_id(self) -> str:
        """Identifies the key without revealing it (12 hex of a salted sha256)."""
        return hashlib.sha256(b"deployctl-api-key\0" + self.value.encode()).hexdigest()[:12]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.value}"}

    def describe(self) -> str:
        return f"API key from {self.source} (id {self.key_id})"


def load_api_key(cluster: "Cluster", environ: "dict[str, str] | None" = None) -> ApiKey | None:
    """The key the inventory points at (None: the API is open). Bad input names the inventory key."""
    return load_key(cluster.api_key_file, cluster.api_key_env, str(cluster.file), "all.vars", environ)


def load_key(key_file: str | None, key_env: str | None, file: str, where: str,
             environ: "dict[str, str] | None" = None) -> ApiKey | None:
    """A key from KEY_FILE or the environment variable KEY_ENV (None: neither set); errors name
    WHERE.api_key_file / WHERE.api_key_env in the inventory FILE."""
    env = os.environ if environ is None else environ
    if key_file:
        path = Path(key_file)
        try:
            value = path.read_text().strip()
        except OSError as e:
            raise InputError(f"cannot read the API key file {path}: {e.strerror or e}", file=file,
                             key=f"{where}.api_key_file") from None
        source, key = f"file {path}", f"{where}.api_key_file"
    elif key_env:
        value = env.get(key_env, "").strip()
        if not value:
            raise InputError(f"the environment variable {key_env} (the API key) is not set or empty",
                             file=file, key=f"{where}.api_key_env")
        source, key = f"environment variable {key_env}", f"{where}.api_key_env"
    else:
        return None
    if len(value) < MIN_LENGTH or any(c.isspace() or not c.isprintable() for c in value):
        raise InputError(f"the API key from {source} must be at least {MIN_LENGTH} printable characters "
                         "without spaces or newlines", file=file, key=key)
    register_secret(value)
    return ApiKey(value, source)


def rotation(running: "dict[str, str | None]", key: ApiKey | None) -> str | None:
    """What a launch does about the key, from the key id each host's running engine carries (its LABEL;
    None or "": started without a key). None when nothing changes. Names ids, never keys."""
    now = key.key_id if key else ""
    changed = sorted(h for h, was in running.items() if (was or "") != now)
    if not changed:
        return None
    was = sorted({running[h] or "none" for h in changed})
    hosts = "every engine" if len(changed) == len(running) else "the engines on " + ", ".join(changed)
    return (f"the API key changed (id {', '.join(was)} -> {now or 'none'}): launch relaunches {hosts}")


def sglang_config(key: ApiKey) -> str:
    """The YAML SGLang's --config reads (the key as a JSON string: a valid YAML scalar whatever it holds)."""
    return f"api-key: {json.dumps(key.value)}\n"
