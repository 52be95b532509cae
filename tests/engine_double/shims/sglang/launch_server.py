"""Shim for `python3 -m sglang.launch_server ...`: runs the engine double as SGLang."""
import os
import sys


def _home() -> str:
    here = os.path.dirname(os.path.realpath(__file__))
    shims = os.path.dirname(here)
    for cand in (os.environ.get("ENGINE_DOUBLE_HOME"), os.path.join(shims, os.pardir), "/opt/engine_double"):
        if cand and os.path.isfile(os.path.join(cand, "engine_double.py")):
            return os.path.abspath(cand)
    sys.exit("sglang shim: engine_double.py not found (set ENGINE_DOUBLE_HOME)")


def main() -> int:
    sys.path.insert(0, _home())
    import engine_double

    return engine_double.main(["sglang", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
