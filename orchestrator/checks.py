"""Value rules shared by recipes and inventories: ports, counts, sizes, names, image references, paths.

Each check raises InputError naming the file and the key. The grammars are upstream's (cited
where written): a value docker or the engine would refuse on the host is refused here, at load
time, before `up` has stopped anything that was running.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from .errors import InputError

Check = Callable[[Any, str, str], None]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    """A number as the user wrote it (the schema turns 3 into 3.0 for float fields)."""
    return f"{v:g}" if isinstance(v, float) and v.is_integer() else repr(v)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def port(v: Any, file: str, key: str) -> None:
    if not _is_int(v) or not 1 <= v <= 65535:
        raise InputError(f"expected a TCP port 1..65535, got {v!r}", file=file, key=key)


def positive(v: Any, file: str, key: str) -> None:
    """Timeouts, intervals, geometry: 0 would never wait, never poll, or divide by zero."""
    if not _is_num(v) or not 0 < v < math.inf:
        raise InputError(f"must be > 0, got {_shown(v)}", file=file, key=key)


def non_negative(v: Any, file: str, key: str) -> None:
    """Margins and budgets: 0 turns a guard off knowingly; a negative one would let it pass anything."""
    if not _is_num(v) or not 0 <= v < math.inf:
        raise InputError(f"must be >= 0, got {_shown(v)}", file=file, key=key)


def count(v: Any, file: str, key: str) -> None:
    if not _is_int(v) or v < 1:
        raise InputError(f"must be a whole number >= 1, got {v!r}", file=file, key=key)


# Docker's size grammar, as `docker run --shm-size/--memory` parse it: docker/cli opts.MemBytes ->
# github.com/docker/go-units RAMInBytes (size.go parseSize): a number (one optional decimal part;
# one optional space), then an optional unit b, or k/m/g/t/p with an optional "b" or "ib",
# case-insensitive; a negative size is refused ("Backward compatibility: reject negative sizes").
# Go's ParseFloat would also take "1e3" or ".5"; those are refused here (stricter, never looser).
_DOCKER_SIZE = re.compile(r"[0-9]+(\.[0-9]+)? ?(b|[kmgtp](i?b)?)?", re.IGNORECASE)


def docker_size(v: Any, file: str, key: str, *, swap: bool = False) -> None:
    # docker/cli opts.MemSwapBytes.Set: "-1" (unlimited swap) is the one value below zero it takes
    if swap and str(v) == "-1":
        return
    if not isinstance(v, str) or not _DOCKER_SIZE.fullmatch(v):
        raise InputError(f"expected a docker memory size such as 512m, 32g or 1.5GiB, got {v!r}",
                         file=file, key=key)


# docker daemon/names/names.go: RestrictedNameChars = `[a-zA-Z0-9][a-zA-Z0-9_.-]`, a container
# name matches `^` + RestrictedNameChars + `+$` (one character is enough here). The deployment name
# and host names go into container names and into run-record paths, so ".." is refused too.
_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")


def name(v: Any, file: str, key: str) -> None:
    if not isinstance(v, str) or not _CONTAINER_NAME.fullmatch(v) or ".." in v:
        raise InputError(f"expected a name of letters, digits, '_', '.', '-' starting with a letter or "
                         f"digit, without '..' (Docker's container-name rule), got {v!r}",
                         file=file, key=key)


# distribution/reference (reference.go, regexp.go), what `docker pull/run` parse:
#   reference := name [":" tag] ["@" digest];  name := [domain "/"] path-component ["/" path-component]*
#   domain    := domain-component ["." domain-component]* [":" port-number]   (or [IPv6])
#   domain-component := [a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]
#   path-component   := [a-z0-9]+ (separator [a-z0-9]+)*;  separator := [_.]|__|[-]+
#   tag := [\w][\w.-]{0,127};  digest := algorithm ":" hex  (sha256: 64 lowercase hex, go-digest)
# The name is at most 255 characters (reference.NameTotalLengthMax).
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[_.]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_DIGEST = r"(?P<alg>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*):(?P<hex>[0-9a-fA-F]{32,})"
_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::[\w][\w.-]{{0,127}})?(?:@{_DIGEST})?", re.ASCII)


def image_ref(v: Any, file: str, key: str) -> None:
    m = _REFERENCE.fullmatch(v) if isinstance(v, str) else None
    ok = bool(m) and len(m["name"]) <= 255
    if ok and m["alg"] == "sha256":
        ok = re.fullmatch(r"[0-9a-f]{64}", m["hex"]) is not None
    if not ok:
        raise InputError(f"expected a Docker image reference such as vllm/vllm-openai:v0.33.0 or "
                         f"registry:5000/team/img@sha256:<64 hex> (lowercase repository), got {v!r}",
                         file=file, key=key)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def path(v: Any, file: str, key: str) -> None:
    """A path (or path-like text): one line of printable characters. A newline or NUL in a path
    breaks the command lines and files it is written into."""
    if v is None:
        return
    m = _CONTROL.search(str(v))
    if m:
        raise InputError(f"contains the control character {m.group()!r} at position {m.start()}; "
                         f"a path must be printable text on one line, got {v!r}", file=file, key=key)


def subdir(v: Any, file: str, key: str) -> None:
    """A folder below another one (nvme_dir, model_cache): relative, and never climbing out."""
    path(v, file, key)
    s = str(v)
    if s.startswith("/") or ".." in s.split("/"):
        raise InputError(f"must be a relative folder that stays below its parent (no leading '/', no "
                         f"'..'), got {v!r}", file=file, key=key)


# huggingface_hub utils/_validators.py validate_repo_id: [namespace "/"] name, each [\w.-]{1,96},
# not starting or ending with '-' or '.', and no "--" or ".." (the cache folder is models--ORG--NAME).
_REPO_PART = r"(?![-.])[\w.-]{1,96}(?<![-.])"
_REPO_ID = re.compile(rf"(?:{_REPO_PART}/)?{_REPO_PART}", re.ASCII)


def hf_repo(v: Any, file: str, key: str) -> None:
    if not isinstance(v, str) or not _REPO_ID.fullmatch(v) or "--" in v or ".." in v:
        raise InputError(f"expected a Hugging Face repo id such as deepseek-ai/DeepSeek-V4.1-Flash, "
                         f"got {v!r}", file=file, key=key)


RULES: dict[str, Check] = {"port": port, "positive": positive, "non_negative": non_negative,
                           "count": count, "size": docker_size, "name": name, "image": image_ref,
                           "path": path, "subdir": subdir}


def fields(obj: Any, where: str, file: str, **rules: tuple[str, ...]) -> None:
    """Check fields of a dataclass by rule: fields(self, path, file, port=("port",), count=(...)).
    A tuple is checked item by item (key[i]); None (an unset optional field) is skipped."""
    for rule, names in rules.items():
        check = RULES[rule]
        for n in names:
            v, key = getattr(obj, n), f"{where}.{n}" if where else n
            if isinstance(v, tuple):
                for i, item in enumerate(v):
                    check(item, file, f"{key}[{i}]")
            elif v is not None:
                check(v, file, key)


# engine.args whose names say they are counts or sizes: a zero or negative integer there is a typo
# that the engine takes (or crashes on) long after `up` stopped the running deployment. The
# released engines document a few such values as switches (their own --help text, read from
# vLLM 0.33.0 and SGLang 0.5.23, the versions in tests/conformance/versions.txt): those pass.
_COUNT_ARG = re.compile(r"max-.*|.*-(size|len|seqs|tokens)")
ARG_SWITCHES: dict[str, dict[str, set[int]]] = {
    "vllm": {"max-model-len": {-1},               # "-1 or 'auto'": the longest that fits
             "ubatch-size": {0}, "offload-group-size": {0}},                  # 0: the default, off
    "sglang": {"chunked-prefill-size": {-1},       # "-1 means disabling chunked prefill"
               "expert-distribution-recorder-buffer-size": {-1},             # "-1: infinite buffer"
               "offload-group-size": {-1}, "hicache-size": {0},               # their defaults
               "speculative-domino-candidate-pool-size": {0},                # "0: the full vocabulary"
               "speculative-draft-sink-size": {0}},                          # "0/unset: pure window"
}


def engine_args(kind: str, args: dict[str, Any], file: str, where: str) -> None:
    for flag, v in args.items():
        flag = str(flag)
        if not _COUNT_ARG.fullmatch(flag):
            continue
        n = v if _is_int(v) else int(v) if isinstance(v, str) and re.fullmatch(r"\s*-?[0-9]+\s*", v) else None
        if n is not None and n < 1 and n not in ARG_SWITCHES.get(kind, {}).get(flag, ()):
            raise InputError(f"--{flag} is a count or size: expected a whole number >= 1, got {v!r}",
                             file=file, key=f"{where}.{flag}")
