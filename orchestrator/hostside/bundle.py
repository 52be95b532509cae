"""Build `deployctl-tables.pyz`: the host-side table operations as one zipapp.

Nodes have python3 but not deployctl; the stage playbooks copy this file to the
node and run `python3 deployctl-tables.pyz OP ...`. The archive holds only modules
that need nothing beyond the standard library. Its name carries a digest of its
content, so a node keeps a current copy and a changed one is copied again.
"""
from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

from ..fsutil import atomic_write_bytes

PKG = Path(__file__).resolve().parent.parent          # orchestrator/
MODULES = ("__init__.py", "errors.py", "fsutil.py")
MAIN = "import sys\nfrom orchestrator.hostside.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"


def _members() -> list[tuple[str, bytes]]:
    files = [(f"orchestrator/{m}", (PKG / m).read_bytes()) for m in MODULES]
    for p in sorted((PKG / "hostside").glob("*.py")):
        files.append((f"orchestrator/hostside/{p.name}", p.read_bytes()))
    for p in sorted((PKG / "hostside" / "page").glob("*.*")):     # the status page's assets (status_page.py)
        files.append((f"orchestrator/hostside/page/{p.name}", p.read_bytes()))
    files.append(("__main__.py", MAIN.encode()))
    return files


def digest() -> str:
    return hashlib.sha256(b"".join(n.encode() + b"\0" + d for n, d in _members())).hexdigest()[:12]


def file_name() -> str:
    return f"deployctl-tables-{digest()}.pyz"


def build(dest_dir: str | Path) -> Path:
    """Write the zipapp into dest_dir (if not already there) and return its path."""
    out = Path(dest_dir) / file_name()
    if out.exists():
        return out
    atomic_write_bytes(out, data())
    return out


def data() -> bytes:
    """The zipapp's bytes (reproducible: fixed member times)."""
    members = _members()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, body in members:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))  # reproducible
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, body)
    return buf.getvalue()
