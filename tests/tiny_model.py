"""A tiny checkpoint of a real architecture, made deterministically from a seed: what the real vLLM
(its CPU build) serves on the test cluster (tests/test_real_vllm.py, `python3 -m tests.cluster demo
--real-vllm`).

Llama (transformers `LlamaForCausalLM`: config.json with `architectures: [LlamaForCausalLM]`), 2 layers,
hidden 256, 4 attention heads of head_dim 64 (the CPU build's attention refuses head_dim 16:
"Unsupported CPU attention configuration"), 4 KV heads (divisible by TP=4, so no rank replicates one),
float32 weights in one safetensors file, a byte-level BPE tokenizer trained with `tokenizers` on a
corpus made from the seed, and a chat template in tokenizer_config.json (what transformers'
`apply_chat_template` and vLLM's chat endpoint read).

The weights are scaled so that the logits spread over several units (embeddings ~N(0,1), each linear
~N(0, 1/fan_in), the LM head ~N(0, 4/hidden)): greedy decoding then has gaps between the best two
tokens far larger than float32 rounding, so TP=1, TP=4 and transformers agree token for token.
The special tokens' LM-head rows are zero, so a greedy answer never stops early at EOS.

Same seed, same bytes (tests/test_tiny_model.py checks it): the Hub endpoint gives the same commit id.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL = ("<|bos|>", "<|eos|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ("one two three four five six seven eight nine ten eleven twelve count from to and the a of in is "
         "it model node spark cluster token fabric memory table row rank head worker engine serve answer "
         "hello world quick brown fox jumps over lazy dog red green blue yellow north south east west").split()


@dataclass(frozen=True)
class TinyLlama:
    seed: int = 1234
    vocab_size: int = 1024
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    max_positions: int = 2048
    served_name: str = "tiny-llama"

    def config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_positions,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
            "torch_dtype": "float32", "dtype": "float32",
            "deployctl_tiny_model": asdict(self),
        }


SYLLABLES = ("ka ri to ne mu sa lo pe di fa gu hi jo ve zu bra tel mon dor quin sept"
             " ar el in on um ex").split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Sentences of WORDS and of made-up words (syllables): enough distinct pairs for the BPE
    trainer to fill the whole vocabulary."""
    rnd = random.Random(seed)
    vocab = list(WORDS) + ["".join(rnd.choice(SYLLABLES) for _ in range(rnd.randint(2, 4))) for _ in range(600)]
    out = []
    for _ in range(lines):
        n = rnd.randint(4, 14)
        out.append(" ".join(rnd.choice(vocab) for _ in range(n)) + rnd.choice((".", "?", "!", ",")))
    out += [" ".join(WORDS[:k]) for k in range(1, 13)]          # counting, as the reports' probe asks
    return out


def tokenizer_json(m: TinyLlama) -> str:
    """The byte-level BPE tokenizer as tokenizer.json text (deterministic: one thread, sorted corpus)."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=m.vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(m.seed), trainer=trainer)
    if tok.get_vocab_size() != m.vocab_size:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model {m.vocab_size}")
    return tok.to_str()


def weights(m: TinyLlama) -> dict:
    """name -> float32 array, from the seed (numpy's PCG64: the same on every machine)."""
    import numpy as np
    rng = np.random.default_rng(m.seed)

    def lin(out_f: int, in_f: int) -> "np.ndarray":
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    w = {"model.embed_tokens.weight": rng.standard_normal((m.vocab_size, m.hidden)).astype(np.float32)}
    for i in range(m.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(q, m.hidden)
        w[p + "self_attn.k_proj.weight"] = lin(kv, m.hidden)
        w[p + "self_attn.v_proj.weight"] = lin(kv, m.hidden)
        w[p + "self_attn.o_proj.weight"] = lin(m.hidden, q)
        w[p + "mlp.gate_proj.weight"] = lin(m.intermediate, m.hidden)
        w[p + "mlp.up_proj.weight"] = lin(m.intermediate, m.hidden)
        w[p + "mlp.down_proj.weight"] = lin(m.hidden, m.intermediate)
        w[p + "input_layernorm.weight"] = np.ones(m.hidden, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(m.hidden, np.float32)
    w["model.norm.weight"] = np.ones(m.hidden, np.float32)
    head = (rng.standard_normal((m.vocab_size, m.hidden)) * (2.0 / np.sqrt(m.hidden))).astype(np.float32)
    head[: len(SPECIAL)] = 0.0                   # never the greedy choice: answers run to max_tokens
    w["lm_head.weight"] = head
    return w


def files(m: TinyLlama) -> dict[str, bytes]:
    """Every file of the checkpoint: name -> bytes."""
    from safetensors.numpy import save
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
               "pad_token": SPECIAL[2], "model_max_length": m.max_positions, "add_bos_token": False,
               "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    gen = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False}
    return {
        "config.json": (json.dumps(m.config(), indent=2, sort_keys=True) + "\n").encode(),
        "generation_config.json": (json.dumps(gen, indent=2, sort_keys=True) + "\n").encode(),
        "tokenizer.json": tokenizer_json(m).encode(),
        "tokenizer_config.json": (json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n").encode(),
        "special_tokens_map.json": (json.dumps({"bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
                                                "pad_token": SPECIAL[2]}, indent=2) + "\n").encode(),
        "model.safetensors": save(weights(m), metadata={"format": "pt"}),
    }


def write(folder: str | Path, m: TinyLlama = TinyLlama()) -> Path:
    """The checkpoint in FOLDER (each file atomically; a folder already holding these bytes is kept)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files(m).items():
        p = folder / name
        if p.exists() and p.read_bytes() == data:
            continue
        tmp = p.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)
    return folder


if __name__ == "__main__":
    import sys
    print(write(sys.argv[1]))
