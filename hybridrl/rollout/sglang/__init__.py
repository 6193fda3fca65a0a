"""The SGLang adapter: one ``sglang.Engine`` per gen-TP group, fed by the reshard (GPU).

Contract (docs/rollout.md has the lifecycle and the memory of each phase):
- ``adapter``: ``build_sglang_engine`` (collective; placement, start, the side groups),
  ``SGLangEngine`` (resume -> update -> flush -> generate -> release), ``sglang_backend`` (the
  import and version check), ``SGLangBackend`` (what the adapter takes from SGLang).
- ``push``: ``WeightPusher``, matched push rounds of one gen-TP group's shards, one per reshard
  phase; ``layout``: the parameters and per-rank shapes SGLang's models hold, and a gen layout
  whose gen-TP groups follow SGLang's GPU order; ``loader``: the custom weight loader a MoE
  model's push goes through (per-expert shards into FusedMoE); ``env``: what an engine may
  change in the trainer process and how it is contained; ``balance``: free memory across a
  gen-TP group at the start, SGLang's 90 % rule; ``compat``: the supported releases and the
  facts the adapter branches on.
Nothing here imports ``sglang`` at module level: the package imports on any machine, SGLang
itself only when an engine is built. Imports only downward (``hybridrl.rollout``'s protocol and
sampling, reshard, config). Names of the former module ``hybridrl.rollout.sglang`` resolve from
``adapter`` with a DeprecationWarning (removed in 0.3).
"""

from hybridrl.deprecation import forward_attr


def __getattr__(name: str):
    return forward_attr(__name__, name, ("hybridrl.rollout.sglang.adapter",), "0.3")
