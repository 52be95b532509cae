"""Secrets never reach logs, plans, run records or the console.

A value is secret when its name says so (HF_TOKEN, hf-token, MY_SECRET, DB_PASSWORD, api-key ...; see
is_secret_name), or when it was registered: the serving API key (apikey.py), the values of a recipe's
secret-named engine.env and engine.args (deployment.py), the expanded ${VAR}s of secret-named engine.env
entries (launch). Masking replaces, whole (spaces and quotes included):
- in a mapping: every value under a secret-named key (mask_data);
- in an argv: the element after `--<secret-name>`, and V in `--<secret-name>=V` and `NAME=V` elements
  (`-e NAME=V`, `--set engine.env.NAME=V`) (mask_argv; mask_data treats every list of strings so);
- in text: registered and environment secret values anywhere, `--<secret-name> V`, `--<secret-name>=V`,
  `NAME=V` with V bare, "quoted" or 'quoted', and `"<secret-name>": "V"` in JSON or Python reprs (mask_text).
Masking is for what deployctl writes and shows; the engines get the real values (launch/containers.py).
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterable

MASK = "***"
# Registered values shorter than this are masked only by position (a flag's value, NAME=...), never
# wherever they occur: a 1-3 character "secret" would mask ordinary words, numbers and digests.
MIN_REGISTERED = 4
# Environment values shorter than this are not taken for secrets (real tokens are long).
MIN_ENVIRONMENT = 6

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")     # HF_TOKEN, hf-token, apiKey -> words
# A name ending in one of these words says where a secret is, or which one, not the secret itself.
_ABOUT = {"file", "files", "path", "dir", "directory", "sock", "socket", "id", "rotation"}
_KEY_KINDS = {"api", "access", "private", "signing", "encryption"}          # <kind> key(s)


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """HF_TOKEN, hf-token, api-key, OPENAI_API_KEY, apikey, DB_PASSWORD, passwd, MY_SECRET, client-secret,
    credentials, auth-token, oauth, AWS_SECRET_ACCESS_KEY. Not: max-tokens, tokenizer, ssl-keyfile,
    HF_TOKEN_FILE, api_key_id (a key's public id), kv_bytes_per_token (a unit)."""
    words = [w.lower() for w in _WORD.findall(name)]
    if not words or words[-1] in _ABOUT:
        return False
    for i, w in enumerate(words):
        if any(s in w for s in ("secret", "passw", "passphrase", "credential")):
            return True
        if w.endswith(("token", "auth", "apikey", "accesskey", "privatekey")):   # not "tokens", "tokenizer"
            if w == "token" and i > 0 and words[i - 1] == "per":     # a unit: kv_bytes_per_token, ms_per_token
                continue
            return True
        if w in ("pass", "creds", "authorization", "bearer"):
            return True
        if w in ("key", "keys") and i > 0 and words[i - 1] in _KEY_KINDS:
            return True
    return False


_REGISTERED: set[str] = set()


def register_secret(value: str) -> None:
    """A secret deployctl read from somewhere other than the environment: masked like the others."""
    if value:
        _REGISTERED.add(value)


def register_named(mapping: dict[str, Any]) -> None:
    """Register the values of MAPPING's secret-named keys (engine.env, engine.args), MIN_REGISTERED
    characters or longer. Skipped: booleans and None (a bare flag or an absent one), structured values
    (masked by position only), and ${VAR} references (not secrets; launch registers what they expand to)."""
    for k, v in mapping.items():
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not is_secret_name(str(k)):
            continue
        text = str(v)
        if len(text) >= MIN_REGISTERED and "${" not in text:
            register_secret(text)


def secret_values(env: dict[str, str] | None = None) -> list[str]:
    """Values of secret-named variables in `env` (default: this process's environment), and the
    registered secrets; longest first (so a secret containing another is masked whole)."""
    env = os.environ if env is None else env
    found = {v for k, v in env.items() if v and len(v) >= MIN_ENVIRONMENT and is_secret_name(k)}
    return sorted(found | _REGISTERED, key=len, reverse=True)


# A value in text: "double quoted", 'single quoted', or up to the next space or quote.
_VALUE = r"""(?:"(?:[^"\\\n]|\\.)*"|'[^'\n]*'|[^\s'"]+)"""
_NAME = r"[A-Za-z_][\w.\-]*"
_QUOTED_ASSIGNMENT = re.compile(rf"""(?<![\w.\-])(["'])(-{{0,2}}{_NAME})=((?:(?!\1)[^\n])*)\1""")  # 'NAME=a b'
_FLAG = re.compile(rf"(?<![\w\-])(--?{_NAME})(=|[ \t]+)(?!-)({_VALUE})")        # --hf-token V, --hf-token=V
_ASSIGNMENT = re.compile(rf"(?<![\w.\-])({_NAME})=({_VALUE})")                  # HF_TOKEN=V
_KEY_VALUE = re.compile(r"""(["'])([^"'\n]+)\1(\s*:\s*)(["'])((?:(?!\4)[^\\\n]|\\.)*)\4""")  # "hf_token": "V"
# (pattern, name group, value group), in this order: a quoted NAME=V before the bare one.
_BY_NAME = ((_QUOTED_ASSIGNMENT, 2, 3), (_FLAG, 1, 3), (_ASSIGNMENT, 1, 2), (_KEY_VALUE, 2, 5))


def mask_text(text: str, values: list[str] | None = None) -> str:
    """Known secret values anywhere, then values by their secret names (see the module docstring)."""
    return _mask_text(text, tuple(secret_values() if values is None else values))


@functools.lru_cache(maxsize=4096)
def _mask_text(text: str, values: tuple[str, ...]) -> str:
    # cached: a run record repeats the same long texts (a host program's source in every host's argv)
    for v in values:
        text = text.replace(v, MASK)
    for pattern, name, value in _BY_NAME:
        text = pattern.sub(lambda m: _masked(m, name, value), text)
    return text


def _masked(m: re.Match, name: int, value: int) -> str:
    """The match with its group VALUE masked when its group NAME is a secret name."""
    if not is_secret_name(m.group(name)):
        return m.group(0)
    s = m.group(0)
    return s[:m.start(value) - m.start(0)] + MASK + s[m.end(value) - m.start(0):]


_ELEMENT = re.compile(rf"(-{{0,2}}{_NAME})=(.+)", re.S)     # one argv element NAME=V or --flag=V


def mask_argv(argv: Iterable[str], values: list[str] | None = None) -> list[str]:
    """An argv as it may be shown: `--<secret-name> V` -> `--<secret-name> ***` (unless the next element
    is another flag: a bare flag), `--<secret-name>=V` and `NAME=V` elements -> `...=***` (V whole,
    spaces included), and mask_text on every other element."""
    values = secret_values() if values is None else values
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next and not a.startswith("--"):
            out.append(MASK)
            hide_next = False
            continue
        m = _ELEMENT.fullmatch(a)
        hide_next = a.startswith("-") and m is None and is_secret_name(a)
        out.append(f"{m.group(1)}={MASK}" if m and is_secret_name(m.group(1)) else mask_text(a, values))
    return out


def mask_override(expr: str) -> str:
    """`engine.env.HF_TOKEN=hf_...` -> `engine.env.HF_TOKEN=***` (a --set expression)."""
    return mask_argv([expr])[0]


def mask_env(env: dict[str, Any]) -> dict[str, Any]:
    return {k: (MASK if is_secret_name(k) and v not in ("", None) else v) for k, v in env.items()}


def _hide(v: Any) -> Any:
    """Every value under a secret-named key (booleans and empty values say nothing, they stay)."""
    if isinstance(v, dict):
        return {k: _hide(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_hide(x) for x in v]
    return v if v is None or isinstance(v, bool) or v == "" else MASK


def mask_data(data: Any, values: list[str] | None = None) -> Any:
    """Mask a JSON-like document: values under secret-named keys, lists of strings as argvs (a command,
    `docker run` lines, --set overrides), and secret values in every string."""
    values = secret_values() if values is None else values
    if isinstance(data, dict):
        return {k: (_hide(v) if isinstance(k, str) and is_secret_name(k) else mask_data(v, values))
                for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        if data and all(isinstance(x, str) for x in data):
            return mask_argv(data, values)
        return [mask_data(v, values) for v in data]
    if isinstance(data, str):
        return mask_text(data, values)
    return data
