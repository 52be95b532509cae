"""Probe: the reference the deployed real vLLM is held to (tests/test_real_vllm.py): transformers'
own greedy generation on the Hub's copy of the checkpoint, in float32, from the same prompt token ids.

stdin:  {"model_dir": DIR, "prompts": [[ids...], ...], "new_tokens": N}
stdout: {"ids": [[ids...], ...], "transformers": VERSION, "torch": VERSION}
"""
from __future__ import annotations

from _common import run


def probe(p: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(p["model_dir"], dtype=torch.float32)
    model.eval()
    out = []
    for ids in p["prompts"]:
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=p["new_tokens"], min_new_tokens=p["new_tokens"],
                               do_sample=False)
        out.append(g[0, len(ids):].tolist())
    return {"ids": out, "transformers": transformers.__version__, "torch": torch.__version__}


if __name__ == "__main__":
    run(probe)
