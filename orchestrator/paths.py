"""Where the project's data folders are (recipes, dockerfiles, playbooks, inventories)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = ROOT / "recipes"
DOCKERFILES_DIR = ROOT / "dockerfiles"
PLAYBOOKS_DIR = ROOT / "playbooks"
INVENTORIES_DIR = ROOT / "inventories"
