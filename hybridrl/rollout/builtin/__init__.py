"""The builtin rollout engine: pure-torch llama inference on any device (gloo on CPU).

Contract:
- ``engine``: ``BuiltinEngine`` (one gen TP rank's engine-format shard, KV cache, gen pp = 1) and
  ``EngineSpec`` (its model description); re-exported here: ``from hybridrl.rollout.builtin
  import BuiltinEngine`` is the stable path.
- ``weights``: ``EngineWeights``, its weight store in megatron's gen-layout layout, so the
  reshard writes into it in place (or aliases training tensors).
- ``moe``: the mixture-of-experts feed-forward (Qwen3-MoE routing, experts cut over gen TP)
  and the record of the top-k expert ids ``generate`` returns.
- ``spec``: ``EngineSpec``. ``decode``: ``generate``'s prefill (identical prompts once, kept
  caches continued) and decode loop. ``session``: ``KVSession``, the K/V a caller's sequences
  keep between calls (``BuiltinEngine.open_session``), used by the multi-turn agent loop.
Imports only downward: ``hybridrl.rollout``'s protocol and sampling, models' RoPE, config's RoPE
scaling. Other names of the former module ``hybridrl.rollout.builtin`` resolve from ``engine``,
``decode`` or ``moe`` with a DeprecationWarning (removed in 0.3).
"""

from hybridrl.deprecation import forward_attr
from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

__all__ = ["BuiltinEngine", "EngineSpec"]


def __getattr__(name: str):
    return forward_attr(__name__, name, ("hybridrl.rollout.builtin.engine",
                                         "hybridrl.rollout.builtin.decode",
                                         "hybridrl.rollout.builtin.moe"), "0.3")
