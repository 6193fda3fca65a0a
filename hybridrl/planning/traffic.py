"""Where the reshard's bytes travel: inside a node or across nodes, per GPU per step (pure).

Contract:
- ``reshard_traffic(train, gen, specs, strategy, itemsize, gpus_per_node)`` follows the same
  sources as the executor (``reshard.planner.Sourcer``) and splits each rank's received bytes by
  whether the sending rank is on its node (ranks ``[k * gpus_per_node, (k + 1) * gpus_per_node)``
  share node k, as torchrun numbers them). Returns ``{"intra_node_bytes", "inter_node_bytes"}``,
  each the largest over ranks, and ``"worst_rank"`` (the rank that receives the most across nodes).
  Totals equal ``reshard.summary.summarize``'s received bytes (tests check it).
"""

from __future__ import annotations

from hybridrl.reshard.planner import Sourcer
from hybridrl.reshard.summary import _classes  # layers alike on both sides: counted once


def reshard_traffic(train, gen, specs, strategy: str, itemsize: int, gpus_per_node: int) -> dict:
    """Per-rank bytes received from the same node / other nodes (see the module docstring)."""
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    src = Sourcer(strategy, train, gen, specs)
    w = train.world
    intra, inter = [0] * w, [0] * w
    for key, n in _classes(specs, train, gen):
        for spec in src.by_key[key]:
            row_bytes = spec.row_numel * itemsize * n
            for r in range(w):
                iv = gen.interval(spec, r)
                if iv is None or iv[1] <= iv[0]:
                    continue
                for s, a, b in src.sources(r, key, *iv):
                    if s == r:
                        continue
                    side = intra if s // gpus_per_node == r // gpus_per_node else inter
                    side[r] += (b - a) * row_bytes
    worst = max(range(w), key=lambda r: (inter[r], intra[r]))
    return {"intra_node_bytes": max(intra), "inter_node_bytes": max(inter), "worst_rank": worst,
            "worst_rank_intra_bytes": intra[worst], "gpus_per_node": gpus_per_node}
