"""Where the project's data folders are (recipes, dockerfiles, playbooks, inventories), and the
deployment lock's file on the head (launch/lock.py takes it, the supervisor too)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = ROOT / "recipes"
DOCKERFILES_DIR = ROOT / "dockerfiles"
PLAYBOOKS_DIR = ROOT / "playbooks"
INVENTORIES_DIR = ROOT / "inventories"

LOCK_DIR = "/var/lock"


def lock_path(deployment: str) -> str:
    return f"{LOCK_DIR}/deployctl-{re.sub(r'[^A-Za-z0-9_.-]', '_', deployment)}.lock"
