"""Rollout engines: the protocol, the builtin pure-torch engine and the SGLang adapter.

- ``base``: ``SamplingParams``, ``GenerationOutput``, the ``RolloutEngine`` protocol
  (``update_weights(named_tensors)`` in the engine format, ``generate(prompt_ids, params)``).
- ``sampling``: greedy / temperature / top-k / top-p choice of the next token (pure).
- ``builtin``: ``BuiltinEngine``, llama inference on one gen TP rank's engine-format shard (any
  device; gloo on CPU), KV cache, gen pp = 1.
- ``sglang``: one ``sglang.Engine`` per gen-TP group (imported only when used); ``sglang_push``
  (matched push rounds), ``sglang_layout`` (SGLang's per-rank parameters), ``sglang_compat``
  (supported releases); see docs/rollout.md.
"""

from hybridrl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from hybridrl.rollout.builtin import BuiltinEngine, EngineSpec

__all__ = ["BuiltinEngine", "EngineSpec", "GenerationOutput", "RolloutEngine", "SamplingParams"]
