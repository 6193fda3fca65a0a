"""Per-rank reshard costs without listing transfers: the fast path behind ``hybridrl plan``.

Contract:
- ``summarize(train, gen, specs, strategy, itemsize, bucket_bytes)`` returns a ``Summary`` with,
  per rank, the bytes it receives, sends and must hold as destination, equal to what
  ``plan_reshard`` would plan (tests check this): the bytes of the p2p send / receive buffers the
  executor posts, for every strategy (allgather included: a p2p emulation of an all_gather). It never enumerates elements: layers whose
  parameters sit on the same (train stage, gen stage) behave identically and are counted once
  with a multiplicity, and the baselines (allgather, vanilla) are counted from their owner
  partition in closed form. 1024 ranks take well under a second for llama2-70b.
- ``peak`` per rank is destination + min(4 * bucket_bytes, received + sent): the executor keeps at
  most two buckets live, each receiving and sending at most ``bucket_bytes``.
- ``table2(strategy, t, p, d, dg, M)`` is the closed form of DESIGN.md's Table 2 (exact for models
  whose every parameter is TP-split and balanced over stages; tests use it as the oracle).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from hybridrl.reshard.placement import Placement
from hybridrl.reshard.planner import Sourcer
from hybridrl.reshard.specs import ParamSpec


@dataclasses.dataclass(frozen=True)
class Summary:
    """Per-rank byte counts of one strategy (``summarize``); ``as_dict`` gives the maxima."""

    strategy: str
    recv: tuple[int, ...]
    sent: tuple[int, ...]
    dest: tuple[int, ...]
    peak: tuple[int, ...]

    def as_dict(self) -> dict:
        return {
            "max_bytes_received_per_rank": max(self.recv),
            "max_bytes_sent_per_rank": max(self.sent),
            "total_bytes_moved": sum(self.recv),
            "max_peak_bytes_per_rank": max(self.peak),
            # in flight beyond the destination (the engine's own weights): the buckets
            "max_transient_bytes_per_rank": max(p - d for p, d in zip(self.peak, self.dest)),
        }


def table2(strategy: str, t: int, p: int, d: int, dg: int, model_bytes: int) -> Fraction:
    """Bytes received per rank, HybridFlow Table 2 (p2p: the zero-redundancy minimum)."""
    if strategy == "allgather":
        return Fraction(t * p * d - 1, t * p * d) * model_bytes
    if strategy == "vanilla":
        return Fraction(t * p - 1, t * p) * model_bytes
    if strategy in ("zero_redundancy", "p2p"):
        return Fraction(dg - 1, t * p) * model_bytes
    raise ValueError(f"unknown strategy {strategy!r}")


def _signature(spec: ParamSpec, train: Placement, gen: Placement):
    """Parameters with equal signatures have identical per-rank costs."""
    if spec.layer is None:
        return spec.key
    return (spec.kind, spec.shape, spec.unit, spec.stage(train.pp, train.num_layers),
            spec.stage(gen.pp, gen.num_layers), spec.ep_rank(train.ep))


def _classes(specs: Sequence[ParamSpec], train: Placement, gen: Placement):
    """[(representative key, multiplicity)] over the distinct signatures."""
    first: dict[str, ParamSpec] = {}
    for s in specs:
        first.setdefault(s.key, s)
    counts: Counter = Counter()
    rep: dict = {}
    for key, spec in first.items():
        sig = _signature(spec, train, gen)
        counts[sig] += 1
        rep.setdefault(sig, key)
    return [(rep[sig], n) for sig, n in counts.items()]


def _baseline(src: Sourcer, key: str, n: int, row_bytes: int, recv, sent, dest) -> None:
    """allgather / vanilla: every rank receives all rows it does not own, from their owner."""
    t = src.train
    rows = src.by_key[key][0].rows
    groups = [-1] if src.strategy == "allgather" else sorted({c[2] for c in t.coords})
    receivers = t.world if src.strategy == "allgather" else t.world // len(groups)
    own = [0] * t.world
    for group in groups:
        members = src.everywhere if group == -1 else (lambda sh, g=group: src.in_replica(sh, g))
        for h, a, b in src.owners(key, group, members):
            own[h] += b - a
            sent[h] += (b - a) * (receivers - 1) * row_bytes * n
    for r in range(t.world):
        recv[r] += (rows - own[r]) * row_bytes * n
        dest[r] += rows * row_bytes * n


def summarize(train: Placement, gen: Placement, specs: Sequence[ParamSpec], strategy: str,
              itemsize: int = 2, bucket_bytes: int = 64 << 20) -> Summary:
    """Per-rank bytes received, sent, assembled and at peak that ``plan_reshard`` with these
    arguments would plan, counted without listing transfers (module doc)."""
    src = Sourcer(strategy, train, gen, specs)
    w = train.world
    recv, sent, dest = [0] * w, [0] * w, [0] * w
    for key, n in _classes(specs, train, gen):
        row_bytes = src.by_key[key][0].row_numel * itemsize
        if strategy in ("allgather", "vanilla"):
            _baseline(src, key, n, row_bytes, recv, sent, dest)
            continue
        for r in range(w):
            for spec in src.by_key[key]:
                iv = gen.interval(spec, r)
                if iv is None or iv[1] <= iv[0]:
                    continue
                dest[r] += (iv[1] - iv[0]) * row_bytes * n
                for s, a, b in src.sources(r, key, *iv):
                    if s != r:
                        recv[r] += (b - a) * row_bytes * n
                        sent[s] += (b - a) * row_bytes * n
    peak = [d + min(4 * bucket_bytes, rv + sd) for d, rv, sd in zip(dest, recv, sent)]
    return Summary(strategy, tuple(recv), tuple(sent), tuple(dest), tuple(peak))
