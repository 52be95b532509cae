"""Host-side table operations: `python3 -m orchestrator.hostside OP ARGS...`.

This is what runs on a node (from the shipped zipapp, see bundle.py), with only the
standard library. Each operation is a `main(argv) -> exit code` in its own module;
it prints one JSON result object as its last stdout line.
"""
from __future__ import annotations

import importlib
import sys

OPS = {
    "engram-stage": "orchestrator.hostside.engram_stage",
    "ple-write": "orchestrator.hostside.ple_write",
    "supervise": "orchestrator.hostside.supervisor",
    "router": "orchestrator.hostside.router_keeper",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in OPS:
        print(f"usage: python3 -m orchestrator.hostside {{{','.join(OPS)}}} ...", file=sys.stderr)
        return 2
    module = importlib.import_module(OPS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
