"""Write a Prometheus configuration folder (side effects): everything is staged in a scratch folder
beside the destination, validated there by the real `promtool check config` (which also checks every
rule file it names) and `promtool check rules`, then moved into place file by file with rename(2),
prometheus.yml last. A configuration promtool refuses leaves the destination as it was."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from ..errors import InputError, StageFailed
from ..fsutil import atomic_write_text
from .promconfig import RULES_DIR, TARGETS_DIR

PROMTOOL_TIMEOUT_S = 60.0
CONFIG = "prometheus.yml"


def find_promtool(given: str | None) -> str:
    p = shutil.which(given or "promtool")
    if not p:
        raise InputError(f"{given or 'promtool'} not found: deployctl validates every file with Prometheus' own "
                         "promtool before writing it; install it (Debian/Ubuntu: apt install prometheus) or "
                         "give its path with --promtool", key="--promtool")
    return p


def check(promtool: str, *args: str) -> str:
    try:
        r = subprocess.run([promtool, "check", *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise StageFailed(f"promtool check {' '.join(args)} did not finish in {PROMTOOL_TIMEOUT_S:g}s") from None
    if r.returncode != 0:
        raise StageFailed(f"promtool check {args[0]} refused the generated files (nothing written):\n"
                          + (r.stdout + r.stderr).strip()[-2000:])
    return (r.stdout + r.stderr).strip()


class _Plain(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:      # no &id001 anchors: a person reads these files
        return True


def dump(doc: object) -> str:
    return "# written by deployctl monitor config: edits are replaced the next time it runs\n" + \
        yaml.dump(doc, Dumper=_Plain, sort_keys=False, width=120)


def write_folder(out: Path, files: dict[str, str], promtool: str) -> list[str]:
    """FILES: {path under OUT: text}, prometheus.yml among them. Returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".deployctl-monitor-", dir=out) as tmp:
        stage = Path(tmp)
        for sub in (RULES_DIR, TARGETS_DIR):      # the other deployments' files, as Prometheus will see them
            (stage / sub).mkdir()
            if (out / sub).is_dir():
                for f in (out / sub).iterdir():
                    if f.is_file() and not f.name.startswith("."):
                        shutil.copy2(f, stage / sub / f.name)
        for rel, text in files.items():
            (stage / rel).write_text(text)
        check(promtool, "config", str(stage / CONFIG))
        check(promtool, "rules", *sorted(str(stage / r) for r in files if r.startswith(f"{RULES_DIR}/")))
        for rel in sorted(files, key=lambda r: r == CONFIG):          # prometheus.yml last
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / rel, out / rel)
    return [str(out / r) for r in sorted(files, key=lambda r: r == CONFIG)]


def merge_into(target: Path, merged: dict, promtool: str) -> None:
    """Replace an operator's prometheus.yml by MERGED, checked by promtool beside it first."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".yml", dir=target.parent)
    os.close(fd)
    try:
        Path(tmp).write_text(dump(merged))
        check(promtool, "config", tmp)
    finally:
        os.unlink(tmp)
    atomic_write_text(target, dump(merged))
