"""Shim package: `python3 -m sglang.launch_server ...` runs the engine double (tests only)."""
__version__ = "0.0.0-engine-double"
