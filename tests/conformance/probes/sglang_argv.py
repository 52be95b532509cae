"""Run `python3 -m sglang.launch_server ...` command lines through the released SGLang's own
argument parsing, without starting anything.

stdin:  {"argvs": [["python3", "-m", "sglang.launch_server", "--model-path", M, ...], ...]}
stdout: {"sglang_version": "0.5.23",
         "results": [{"ok": bool, "stage": None | failing stage, "error": None | text,
                      "checks": {stage: "ok" | error text}, "flags": {"--flag": dest},
                      "parsed": {"ple_offload_embedding": ..., "ple_offload_backend": ...,
                                 "ple_offload_dir": ..., "api_key": ...,
                                 "speculative_algorithm": ..., ...}}, ...]}

Stages, as sglang/launch_server.py's __main__ meets them:
  argv     argv[1:3] == ["-m", "sglang.launch_server"]; the flags are argv[3:] (sys.argv[1:])
  plugins  sglang.srt.plugins.load_plugins() (what __main__ calls first)
  parse    sglang.srt.server_args.prepare_server_args(argv[3:]): argparse.ArgumentParser with
           ServerArgs.add_cli_args (the dataclass fields of sglang/srt/arg_groups/fields/*), then
           ServerArgs.from_cli_args; argparse's own error text on failure
  flags    every --flag is an exact option string of that parser (argparse would also take an
           unambiguous prefix)
ServerArgs.resolve_once() (run_server's first step) is not run: its hooks read the checkpoint's
config.json and the GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import argparse_error, argv_result, captured_stderr, error_text, run  # noqa: E402

REPORTED = ("model_path", "served_model_name", "host", "port", "tp_size", "ple_offload_embedding",
            "ple_offload_backend", "ple_offload_dir", "api_key", "speculative_algorithm",
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
            "context_length", "mem_fraction_static", "max_running_requests")


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


def check_one(argv: list[str], option_table: dict[str, argparse.Action]) -> dict[str, Any]:
    from sglang.srt.server_args import prepare_server_args

    res, fail = argv_result()
    checks = res["checks"]

    if len(argv) < 3 or argv[1:3] != ["-m", "sglang.launch_server"]:
        return fail("argv", f"expected `python3 -m sglang.launch_server ...`, got {argv[:3]}")
    checks["argv"] = "ok"
    flags = list(argv[3:])

    with captured_stderr() as buf:
        try:
            server_args = prepare_server_args(flags)
        except SystemExit as e:
            return fail("parse", argparse_error(buf, e))
        except Exception as e:  # noqa: BLE001
            return fail("parse", error_text(e))
    checks["parse"] = "ok"

    for a in flags:
        if not a.startswith("--") or a == "--":
            continue
        name = a.split("=", 1)[0]
        action = option_table.get(name)
        if action is None:
            return fail("flags", f"{name}: not an option of sglang.launch_server (argparse "
                                 f"would take it only as an abbreviation)")
        res["flags"][name] = action.dest
    checks["flags"] = "ok"

    res["parsed"] = {k: _plain(getattr(server_args, k)) for k in REPORTED
                     if hasattr(server_args, k)}
    res["ok"] = True
    return res


def main(payload: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    # The option table of the parser prepare_server_args builds (same two calls).
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    table = parser._option_string_actions
    results = [check_one([str(a) for a in argv], table) for argv in payload["argvs"]]
    return {"sglang_version": importlib.metadata.version("sglang"), "results": results}


if __name__ == "__main__":
    run(main)
