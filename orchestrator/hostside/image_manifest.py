"""Read an image's OCI manifest out of `docker save`: runs ON A HOST (standard library only, with
image_layers.py prepended), as `python3 -c SOURCE SPEC`.

On the containerd image store an image ID is its manifest (or index) digest and the layers are kept
compressed, so neither the config digest (the identity every store keeps) nor which blob holds which
diff_id can be asked of `docker image inspect`. Both are in the manifest, which `docker save` writes
as blobs/sha256/<image id hex>. The blobs come in digest order, so the manifest may come after large
layers: this reads the stream, keeps only small JSON blobs, and stops `docker save` as soon as the
image ID resolves to a manifest (on average after half the blobs; the controller keeps the answer,
which a digest never changes: orchestrator/ship/transfer.py manifest_of).

Formats relied on: the OCI image layout and its index and manifest documents (opencontainers/image-spec
image-layout.md, image-index.md, manifest.md); Docker 25+ writes `docker save` in that layout (moby
v25.0.0 release notes) and lists an image saved by ID in index.json from 25.0.3 (moby/moby#47294), the
fallback used when the ID names no manifest blob.

SPEC (argv[1], JSON): save (argv), image_id, arch (the GOARCH to prefer in an index).
Prints one JSON line: {"manifest", "config", "layers": [blob digest...]} or {"error"}.
"""
from __future__ import annotations

import json
import subprocess
import sys

try:                                   # in the repository; shipped, image_layers.py is prepended to this source
    from .image_layers import TarReader
except ImportError:
    pass

SMALL_JSON = 4 << 20          # a manifest, index or config is far below this
KEEP_TOTAL = 64 << 20         # bound on what is kept while waiting for the manifest


def resolve(docs: dict, digest: str, arch: str) -> "dict | None":
    """DIGEST's manifest, following an index to the ARCH (else the first real) platform's one."""
    for _ in range(4):
        doc = docs.get(digest)
        if doc is None:
            return None
        if isinstance(doc.get("manifests"), list):
            real = [m for m in doc["manifests"]
                    if (m.get("platform") or {}).get("architecture") not in (None, "unknown")
                    or "platform" not in m]
            real = real or doc["manifests"]
            mine = [m for m in real if (m.get("platform") or {}).get("architecture") == arch]
            if not (mine or real):
                return None
            digest = (mine or real)[0].get("digest", "")
            continue
        if isinstance(doc.get("layers"), list) and isinstance(doc.get("config"), dict):
            return {"manifest": digest, "config": doc["config"].get("digest"),
                    "layers": [layer.get("digest") for layer in doc["layers"]]}
        return None
    return None


def scan(stream, image_id: str, arch: str) -> dict:
    docs: dict = {}
    kept = 0
    for m in TarReader(stream):
        top, _, rest = m.name.partition("/")
        key = None
        if top == "blobs" and rest.startswith("sha256/") and len(rest) == 71:
            key = "sha256:" + rest[7:]
        elif m.name == "index.json":
            key = "index.json"
        if key is None or m.size > SMALL_JSON or kept + m.size > KEEP_TOTAL:
            continue
        body = m.read_all(SMALL_JSON)
        if not body or body.lstrip()[:1] != b"{":
            continue
        try:
            docs[key] = json.loads(body)
        except ValueError:
            continue
        kept += len(body)
        found = resolve(docs, image_id, arch)
        if found:
            return found
    # the ID named no manifest (a graph-driver store's ID is the config digest): the index says
    return resolve(docs, "index.json", arch) or {"error": f"no manifest for {image_id} in the archive"}


def main() -> int:
    spec = json.loads(sys.argv[1])
    save = subprocess.Popen(spec["save"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = scan(save.stdout, spec["image_id"], spec.get("arch", ""))
    except Exception as e:  # noqa: BLE001 - a bad stream: say so, with docker save's own words
        out = {"error": f"reading docker save failed: {e}"}
    finally:
        if save.poll() is None:
            save.kill()               # found: the rest of the archive is not needed
        err = save.stderr.read().decode("utf-8", "replace").strip()
        save.wait()
    if "error" in out and err:
        out["error"] += f" (docker save: {err[-300:]})"
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
