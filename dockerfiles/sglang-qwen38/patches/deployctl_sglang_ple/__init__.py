"""deployctl's SGLang patch: keep the PLE table file deployctl wrote instead of rewriting it at boot.

Loaded through SGLang's own extension point, `SGLANG_EXTERNAL_MODEL_PACKAGE=deployctl_sglang_ple`
(sglang/srt/models/registry.py: the external package's `EntryClass` wins over the built-in model of
the same architecture name). Without that variable the image runs upstream SGLang unchanged.

- prewritten.py: the check (standard library only; the test double imports the same file).
- qwen4_exp_prewritten.py: `Qwen4ExpForConditionalGeneration`, upstream's class with a load_weights
  that drops the PLE shard tensors when every table file passed the check.
"""
