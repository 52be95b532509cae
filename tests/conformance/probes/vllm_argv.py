"""Run `vllm serve ...` command lines through the released vLLM's own CLI, without serving.

stdin:  {"argvs": [["vllm", "serve", MODEL, "--flag", ...], ...]}
stdout: {"vllm_version": "0.33.0",
         "results": [{"ok": bool, "stage": None | failing stage, "error": None | text,
                      "checks": {stage: "ok" | error text | "skipped: why"},
                      "flags": {"--flag": dest}, "parsed": {dest: value}}, ...]}

Stages, in the order `vllm serve` meets them (vllm/entrypoints/cli/main.py: main, serve.py):
  argv       argv[0] == "vllm" and argv[1] == "serve"
  parse      the top-level FlexibleArgumentParser with the `serve` subparser that
             ServeSubcommand.subparser_init builds (make_arg_parser: FrontendArgs +
             AsyncEngineArgs), parse_args(argv[1:]); argparse's own error text on failure
  flags      every --flag of the argv is an exact option string of that parser (argparse would
             also accept an unambiguous prefix, which the engine's docs do not promise)
  validate   ServeSubcommand.validate -> validate_parsed_serve_args (quick checks before loading)
  engine_args  AsyncEngineArgs.from_cli_args(args) (EngineArgs.__post_init__ builds the
             compilation / engram / ... sub-configs from their JSON)
  speculative_config  SpeculativeConfig field validation (types, Literal choices, extra keys
             forbidden) of --speculative-config, without __post_init__ (which needs the target
             model's config, i.e. the checkpoint)
  api_server  what the API server checks before the engine starts (launchers/launcher.py:
             setup_server): init_parser_plugin + validate_api_server_args, after the frontend
             parser flags are merged as EngineArgs.create_structured_outputs_config does
  parsers    the named reasoning / tool parsers resolve to their classes in the released package
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import argparse_error, argv_result, captured_stderr, error_text, run  # noqa: E402

REPORTED = ("model", "model_tag", "served_model_name", "host", "port", "tensor_parallel_size",
            "nnodes", "node_rank", "master_addr", "master_port", "headless",
            "distributed_executor_backend", "gpu_memory_utilization", "max_model_len",
            "max_num_seqs", "max_num_batched_tokens", "block_size", "speculative_config",
            "default_chat_template_kwargs", "tool_call_parser", "enable_auto_tool_choice",
            "reasoning_parser", "limit_mm_per_prompt", "compilation_config", "engram_config",
            "mm_processor_cache_gb")


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    if dataclasses.is_dataclass(v):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)
                if not f.name.startswith("_")}
    return str(v)


def _use_cpu_platform() -> str:
    """No GPU here: vLLM's platform detection finds none and leaves UnspecifiedPlatform, whose
    empty device type fails DeviceConfig (a default the parser builds). Select the CPU platform,
    exactly as `vllm bench` does in vllm/entrypoints/cli/main.py. Of what this probe runs, only
    --mm-processor-device's choices depend on it (they add the platform's device type); the
    compilation pass checks that read it only warn."""
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    return type(platforms.current_platform).__name__


def _build_parser():
    """The parser `vllm` builds in main(), with the one subcommand this probe needs."""
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.entrypoints.common.startup import VLLM_SUBCMD_PARSER_EPILOG
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI",
                                    epilog=VLLM_SUBCMD_PARSER_EPILOG.format(subcmd="[subcommand]"))
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    (serve,) = cmd_init()
    serve_parser = serve.subparser_init(subparsers)
    serve_parser.set_defaults(dispatch_function=serve.cmd)
    return parser, serve_parser, serve


def _check_flags(serve_parser, argv: list[str]) -> dict[str, str]:
    """Map each --flag to the parser's action dest; raise on one that is not an exact option."""
    known = serve_parser._option_string_actions       # argparse's own table of option strings
    out: dict[str, str] = {}
    for a in argv[2:]:
        if not a.startswith("--") or a == "--":
            continue
        name = a.split("=", 1)[0]
        # FlexibleArgumentParser accepts --a_b for --a-b and --cfg.key for --cfg {"key": ..}
        base = name.split(".", 1)[0].rstrip("+")
        norm = "--" + base[2:].replace("_", "-")
        action = known.get(norm) or known.get(base)
        if action is None:
            raise ValueError(f"{name}: not an option of `vllm serve` (argparse would take it "
                             f"only as an abbreviation)")
        out[name] = action.dest
    return out


def _speculative_fields(spec: dict[str, Any]) -> None:
    from vllm.config.speculative import SpeculativeConfig

    data = {k.replace("-", "_"): v for k, v in spec.items()}
    original = SpeculativeConfig.__post_init__
    SpeculativeConfig.__post_init__ = lambda self: None      # needs the checkpoint's config
    try:
        SpeculativeConfig(**data)
    finally:
        SpeculativeConfig.__post_init__ = original


def check_one(argv: list[str], built) -> dict[str, Any]:
    parser, serve_parser, serve = built
    res, fail = argv_result()
    checks = res["checks"]

    if len(argv) < 2 or argv[0] != "vllm" or argv[1] != "serve":
        return fail("argv", f"expected `vllm serve ...`, got {argv[:2]}")
    checks["argv"] = "ok"

    with captured_stderr() as buf:
        try:
            args = parser.parse_args(list(argv[1:]))
        except SystemExit as e:
            return fail("parse", argparse_error(buf, e))
        except Exception as e:  # noqa: BLE001 - FlexibleArgumentParser raises ValueError too
            return fail("parse", error_text(e))
    checks["parse"] = "ok"

    try:
        res["flags"] = _check_flags(serve_parser, argv)
    except ValueError as e:
        return fail("flags", str(e))
    checks["flags"] = "ok"

    try:
        serve.validate(args)
    except Exception as e:  # noqa: BLE001
        return fail("validate", error_text(e))
    checks["validate"] = "ok"

    # ServeSubcommand.cmd: the positional model wins over --model
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    res["parsed"] = {k: _jsonable(getattr(args, k)) for k in REPORTED if hasattr(args, k)}

    import vllm
    try:
        engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    except Exception as e:  # noqa: BLE001
        return fail("engine_args", error_text(e))
    checks["engine_args"] = "ok"
    for k in ("compilation_config", "engram_config"):
        if hasattr(engine_args, k):
            res["parsed"][k] = _jsonable(getattr(engine_args, k))

    if args.speculative_config:
        try:
            _speculative_fields(args.speculative_config)
        except Exception as e:  # noqa: BLE001
            return fail("speculative_config", error_text(e))
        checks["speculative_config"] = "ok"
    else:
        checks["speculative_config"] = "skipped: no --speculative-config"

    from vllm.entrypoints.common.cli_args import init_parser_plugin, validate_api_server_args
    try:
        engine_args.create_structured_outputs_config()   # shares its object with args
        init_parser_plugin(args)
        validate_api_server_args(args)
    except Exception as e:  # noqa: BLE001
        return fail("api_server", error_text(e))
    checks["api_server"] = "ok"

    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    try:
        if args.reasoning_parser:
            ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
        if args.tool_call_parser:
            ToolParserManager.get_tool_parser(args.tool_call_parser)
    except Exception as e:  # noqa: BLE001
        return fail("parsers", error_text(e))
    checks["parsers"] = "ok"

    res["ok"] = True
    return res


def main(payload: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata

    platform = _use_cpu_platform()
    built = _build_parser()
    results = [check_one([str(a) for a in argv], built) for argv in payload["argvs"]]
    return {"vllm_version": importlib.metadata.version("vllm"), "platform": platform,
            "results": results}


if __name__ == "__main__":
    run(main)
