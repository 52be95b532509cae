"""Build the engine double's image (tests/engine_double/Dockerfile) for tests that run it directly.

The build context is the double's folder plus the SGLang patch package the real image carries
(dockerfiles/sglang-qwen38/patches/deployctl_sglang_ple), as the test-double chain assembles it.
Always built (Docker's layer cache makes an unchanged build a no-op in about a second): an image
left by an older checkout on the same engine must not stand in for the current double.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOUBLE_DIR = REPO / "tests" / "engine_double"
PATCH_PACKAGE = REPO / "dockerfiles" / "sglang-qwen38" / "patches" / "deployctl_sglang_ple"


def build(tag: str, base: str = "dctl-debian:bookworm", timeout: float = 600) -> None:
    with tempfile.TemporaryDirectory(prefix="dctl-double-ctx-") as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(DOUBLE_DIR, ctx, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copytree(PATCH_PACKAGE, ctx / PATCH_PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        p = subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE={base}", "-t", tag, str(ctx)],
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"building {tag} failed: {p.stderr[-2000:]}")
