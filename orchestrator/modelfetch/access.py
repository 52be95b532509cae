"""Where fetch-model downloads from and with which token.

The token comes from the inventory's hf_token_file (a file on the controller) or, without one, the
controller's HF_TOKEN (the variable huggingface_hub itself reads: constants.py HF_TOKEN). It is
registered with secrets.py at once, so it is masked wherever it might turn up, and it reaches the
head only inside the job on a command's stdin.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError
from ..secrets import register_secret

if TYPE_CHECKING:
    from ..inventory import Cluster

TOKEN_ENV = "HF_TOKEN"


@dataclass(frozen=True)
class HubAccess:
    endpoint: str
    token: str = field(default="", repr=False)
    token_source: str = ""            # for people: "file /path", "environment variable HF_TOKEN", ""

    def describe(self) -> str:
        return f"{self.endpoint} ({'token from ' + self.token_source if self.token else 'no token'})"


def load_access(cluster: "Cluster", environ: "dict[str, str] | None" = None) -> HubAccess:
    env = os.environ if environ is None else environ
    token, source = "", ""
    if cluster.hf_token_file:
        path = Path(cluster.hf_token_file)
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise InputError(f"cannot read the Hub token file {path}: {e.strerror or e}", file=str(cluster.file),
                             key="all.vars.hf_token_file") from None
        if not token or any(c.isspace() for c in token):
            raise InputError(f"the Hub token file {path} must hold one token without spaces",
                             file=str(cluster.file), key="all.vars.hf_token_file")
        source = f"file {path}"
    elif env.get(TOKEN_ENV, "").strip():
        token, source = env[TOKEN_ENV].strip(), f"environment variable {TOKEN_ENV}"
    if token:
        register_secret(token)
    return HubAccess(cluster.hf_endpoint, token, source)
