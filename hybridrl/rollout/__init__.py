"""Rollout engines: the protocol, the rollout worker, and one room per engine or placement.

At the top of this folder (the protocol and what every engine shares):
- ``base``: ``SamplingParams``, ``GenerationOutput``, the ``RolloutEngine`` protocol
  (``update_weights(named_tensors)`` in the engine format, ``generate(prompt_ids, params)``).
- ``sampling``: greedy / temperature / top-k / top-p choice of the next token, per-request seeds
  (pure).
- ``batch``: the rollout batch and its micro-batches (packed or padded); ``partition``: rows per
  DP rank and the point-to-point hand-off of generated rows; ``engine_sync``: the reshard into
  any engine (``sync_engine``, message merging).
- ``worker``: ``RolloutWorker``, the colocated generation side of a step (reshard -> engine ->
  rows); it picks the engine, so it sits above the engine rooms.
Rooms (each a folder with its own contract; imports run only downward: top -> engines -> worker
-> split, checked by tests/unit/test_layering.py):
- ``builtin/``: ``BuiltinEngine``, llama inference on one gen TP rank's shard, any device.
- ``sglang/``: one ``sglang.Engine`` per gen-TP group (SGLang imported only when used).
- ``split/``: generation on ranks of its own (``parallel.placement=split``): the training side,
  the generation side, the wire between them.
Former module paths (``hybridrl.rollout.sglang_push``, ``.remote``, ...) still import, with a
DeprecationWarning naming the new home, until 0.3 (``MOVED``).
"""

from types import MappingProxyType

from hybridrl.deprecation import redirect_modules
from hybridrl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

__all__ = ["BuiltinEngine", "EngineSpec", "GenerationOutput", "RolloutEngine", "SamplingParams"]

MOVED = MappingProxyType({
    f"{__name__}.{old}": f"{__name__}.{new}" for old, new in (
        ("engine_weights", "builtin.weights"), ("sglang_push", "sglang.push"),
        ("sglang_layout", "sglang.layout"), ("sglang_env", "sglang.env"),
        ("sglang_compat", "sglang.compat"), ("remote", "split.remote"),
        ("gen_server", "split.server"), ("split_link", "split.link"))})
redirect_modules(MOVED, "0.3")
