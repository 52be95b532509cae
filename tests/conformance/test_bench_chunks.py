"""deployctl bench counts the chunks of a streamed chat completion as the released vLLM's own
benchmark does (probes/vllm_stream_chunks.py calls vLLM's `_choice_has_streamed_output`): the
opening chunk with `role` is no token, an empty `content` without `role` is one (a token that
decodes to nothing: a byte-level tokenizer's partial character), so TTFT and ITL start where
`vllm bench serve` starts them."""
from __future__ import annotations

import pytest

from orchestrator.benchmark.loadgen import _is_token
from tests.conformance.engines import run_probe

pytestmark = pytest.mark.timeout(1800)

CHOICES = [
    {"index": 0, "delta": {"role": "assistant", "content": ""}},       # vLLM's opening chunk
    {"index": 0, "delta": {"role": "assistant"}},
    {"index": 0, "delta": {"content": "Hello"}},
    {"index": 0, "delta": {"content": ""}},                            # a token decoding to ""
    {"index": 0, "delta": {"content": None}},
    {"index": 0, "delta": {}, "finish_reason": "length"},              # the closing chunk
    {"index": 0, "delta": {"reasoning": "thinking"}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}},
    {"index": 0, "delta": {"function_call": {"name": "f"}}},
    {"index": 0},
]
# SGLang's and older vLLM servers' reasoning field, which deployctl counts as output and vLLM's
# own benchmark (0.33) does not look at: the one intended difference
OURS_ONLY = [{"index": 0, "delta": {"reasoning_content": "thinking"}}]


def test_stream_chunks_count_as_tokens_as_in_vllm_bench():
    got = run_probe("vllm_stream_chunks", {"choices": CHOICES + OURS_ONLY})
    theirs = got["token"]
    ours = [_is_token(c) for c in CHOICES + OURS_ONLY]
    assert ours[:len(CHOICES)] == theirs[:len(CHOICES)], list(zip(CHOICES, ours, theirs))
    assert theirs[:4] == [False, False, True, True], "the rule this test guards: role chunk no, empty content yes"
    assert ours[len(CHOICES):] == [True] and theirs[len(CHOICES):] == [False]
