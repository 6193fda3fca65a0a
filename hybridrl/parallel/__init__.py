"""Layouts (pure rank math) and the process groups built from them.

``TrainLayout``/``GenLayout`` are pure and importable without torch.distributed;
``build_groups`` and the megatron hand-off live in ``hybridrl.parallel.groups`` and
``hybridrl.parallel.megatron`` and are imported from there.
"""

from hybridrl.parallel.layout import DEFAULT_ORDER, GenLayout, Shard, TrainLayout

__all__ = ["DEFAULT_ORDER", "GenLayout", "Shard", "TrainLayout"]
