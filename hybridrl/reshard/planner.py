"""Pure reshard planner: which rank sends which canonical rows of which parameter to whom.

Contract:
- ``plan_reshard(train, gen, specs, strategy="auto", bucket_mb, itemsize)`` needs no process
  group; every rank calls it with the same arguments and gets the same ``Plan``, keeping its own
  part. ``strategy="auto"`` (the trainer's ``reshard.strategy=auto``) is ``choose_strategy``:
  ``split`` when the generation ranks are apart, ``zero_redundancy`` when it applies (gen shards
  nested in the training shards, hybridflow grouping: what ``gen_placement``'s default
  ``grouping="auto"`` gives them), else ``p2p``.
- A rank's *destination* is a row interval per parameter key: its generation shard for
  ``zero_redundancy`` and ``p2p``; the whole model for the baselines ``allgather`` and ``vanilla``
  (they materialize full tensors, as DeepSpeed-Chat and HybridFlow-V do, then slice).
- Sources (see docs/reshard.md for the costs):
  * ``allgather``: every element has one owner among all N = t*p*d ranks (each TP piece split
    evenly over its holders); a rank receives every element it does not own: (tpd-1)/(tpd)*M.
  * ``vanilla``: owners within the rank's training DP replica (t*p ranks): (tp-1)/(tp)*M.
  * ``zero_redundancy``: HybridFlow grouping only (tg | t, pg | p). A rank keeps what it holds and
    receives the rest of its gen shard from its micro-DP group (same DP replica, same gen
    coordinates): (dg-1)/(tp)*M. A piece several peers hold (a norm) is split evenly over them,
    unless it has at most 64K elements: then the first of them sends it whole. Rows no micro-DP
    peer holds (vocab chunks that a different padding does not nest) come from the nearest
    holder, as in p2p.
  * ``p2p``: any (tg, pg); a rank keeps what it holds and receives exactly the missing rows, each
    from a holder in its own DP replica when one exists: the minimum volume. MoE experts
    (EP > 1): an expert no rank of the receiver's DP replica holds comes from one of its
    holders anywhere (chosen by the receiving rank's index, spreading the load); still exactly
    the missing rows, once.
  * ``split``: the generation ranks are apart from the training ranks (``split_placements``),
    and only this strategy applies there. Each generation rank receives exactly its gen shard,
    once; every piece is cut evenly over ALL its holders (every training DP replica), the cut
    rotated by the gen replica index, so each holder sends 1/d of its piece to every gen replica
    and the sending is balanced over the training ranks that hold the same bytes (a piece of at
    most 64K elements, a norm, travels whole from one holder, rotating too). Training ranks
    receive nothing. ``send_balance(plan)``: max over mean bytes sent per sending rank.
- Every strategy is a list of point-to-point transfers (the executor posts one isend/irecv pair
  each, or one per run of them with merged messages: hybridrl.reshard.coalesce):
  zero_redundancy's micro-DP all-gather becomes p2p exchanges inside the micro-DP group, and
  ``allgather`` is a p2p emulation of an all_gather.
- Transfers are cut into chunks of at most ``bucket_mb`` MiB and grouped greedily, in parameter
  order, into buckets in which no rank sends more than ``bucket_mb`` MiB, nor receives more
  counting, with its last receive of a parameter, the rows of it the rank holds (its local copies
  complete the parameter in that bucket's phase: hybridrl.reshard.schedule). So what one bucket
  completes on a rank is at most ``bucket_mb`` MiB plus the earlier rows of one parameter begun
  in an earlier bucket (a single transfer over the cap forms a bucket of its own).
- ``Plan`` reports bytes received / sent, destination bytes and peak bytes per rank
  (peak = destination + the two largest consecutive buckets' send+receive buffers, the executor's
  live set). ``summarize`` gives the same per-rank byte counts without listing transfers (CLI).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from hybridrl.reshard.placement import Placement
from hybridrl.reshard.specs import ParamSpec

STRATEGIES = ("allgather", "vanilla", "zero_redundancy", "p2p")  # generation on the training ranks
SPLIT = "split"  # generation ranks apart from the training ranks (split_placements)
MiB = 1 << 20
WHOLE_PIECE_NUMEL = 1 << 16  # zero_redundancy: a replicated piece this small has one sender


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rows [lo, hi) of parameter ``key`` (canonical view) from ``src`` to ``dst``."""

    key: str
    src: int
    dst: int
    lo: int
    hi: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """The full reshard plan, the same on every rank (module doc): strategy, both placements,
    the parameter specs, element size, bucket cap; per rank its destination rows (``dests``)
    and the rows it copies from itself (``locals``); the buckets of transfers. The byte methods
    count this plan's transfers for one rank (the ``RunStats`` of ``run_plan`` equal them)."""

    strategy: str
    train: Placement
    gen: Placement
    specs: tuple[ParamSpec, ...]
    itemsize: int
    bucket_bytes: int
    dests: tuple[dict[str, tuple[int, int]], ...]  # per rank: key -> destination rows
    locals: tuple[tuple[tuple[str, int, int], ...], ...]  # per rank: rows it copies from itself
    buckets: tuple[tuple[Transfer, ...], ...]
    _cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def spec(self, key: str) -> ParamSpec:
        """The (first) spec of parameter ``key`` (a tied output copy shares the embedding's)."""
        if "specs" not in self._cache:
            self._cache["specs"] = {}
            for s in self.specs:
                self._cache["specs"].setdefault(s.key, s)
        return self._cache["specs"][key]

    def rank_buckets(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """Per bucket: (this rank's sends, this rank's receives), in plan order (cached)."""
        if ("rank", rank) not in self._cache:
            self._cache[("rank", rank)] = [
                ([t for t in b if t.src == rank], [t for t in b if t.dst == rank])
                for b in self.buckets]
        return self._cache[("rank", rank)]

    def recv_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives over the whole reshard (its local copies not counted)."""
        return sum(t.nbytes for b in self.buckets for t in b if t.dst == rank)

    def sent_bytes(self, rank: int) -> int:
        """Bytes ``rank`` sends over the whole reshard."""
        return sum(t.nbytes for b in self.buckets for t in b if t.src == rank)

    def dest_bytes(self, rank: int) -> int:
        """Bytes of what ``rank`` assembles: its gen shard (the full model for the baselines)."""
        return sum((hi - lo) * self.spec(k).row_numel * self.itemsize
                   for k, (lo, hi) in self.dests[rank].items())

    def transient_bytes(self, rank: int) -> int:
        """Largest send+receive buffer bytes of ``rank`` in two consecutive buckets (live at
        once)."""
        per = [sum(t.nbytes for t in b if rank in (t.src, t.dst)) for b in self.buckets]
        pairs = [a + b for a, b in zip(per, per[1:])] or per or [0]
        return max(pairs)

    def peak_bytes(self, rank: int) -> int:
        """Upper bound of ``rank``'s live bytes while running: destination + two buckets."""
        return self.dest_bytes(rank) + self.transient_bytes(rank)


def send_balance(plan: Plan) -> float:
    """Max over mean bytes sent per training rank (1.0: perfectly balanced; 0 sent: 1.0)."""
    sent = [plan.sent_bytes(r) for r in plan.train.members]
    return max(sent) * len(sent) / sum(sent) if sum(sent) else 1.0


def is_split(train: Placement, gen: Placement) -> bool:
    """Whether the generation ranks are apart from the training ranks."""
    return not set(train.members) & set(gen.members)


def zero_redundancy_reason(train: Placement, gen: Placement) -> str | None:
    """Why zero_redundancy does not apply (None when it does)."""
    if is_split(train, gen):
        return "the generation ranks are apart from the training ranks (use split)"
    if train.tp % gen.tp or train.pp % gen.pp:
        return (f"needs gen tp | train tp and gen pp | train pp; got tg={gen.tp}, t={train.tp}, "
                f"pg={gen.pp}, p={train.pp} (use p2p)")
    if gen.grouping != "hybridflow":
        return f"needs the hybridflow gen grouping, got {gen.grouping!r}"
    return None


def _subtract(lo: int, hi: int, taken: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out, cur = [], lo
    for a, b in sorted(taken):
        if a > cur:
            out.append((cur, min(a, hi)))
        cur = max(cur, b)
        if cur >= hi:
            break
    if cur < hi:
        out.append((cur, hi))
    return [(a, b) for a, b in out if b > a]


def _clip(parts, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(src, a, b) parts clipped to [lo, hi), empty ones dropped."""
    out = []
    for s, a, b in parts:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((s, a, b))
    return out


class Sourcer:
    """Chooses, for a (rank, key, rows) destination, the source rank of every row."""

    def __init__(self, strategy: str, train: Placement, gen: Placement, specs: Sequence[ParamSpec]):
        if strategy not in (*STRATEGIES, SPLIT):
            raise ValueError(f"strategy must be one of {(*STRATEGIES, SPLIT, 'auto')}, "
                             f"got {strategy!r}")
        if strategy == "zero_redundancy" and (why := zero_redundancy_reason(train, gen)):
            raise ValueError(f"zero_redundancy: {why}")
        if train.world != gen.world:
            raise ValueError(f"train world={train.world} != gen world={gen.world}")
        split = is_split(train, gen)
        if split != (strategy == SPLIT):
            raise ValueError(
                "split: needs the generation ranks apart from the training ranks "
                "(split_placements)" if not split else
                f"{strategy}: the generation ranks are apart from the training ranks; only the "
                "split strategy moves weights between disjoint rank sets")
        self.strategy, self.train, self.gen = strategy, train, gen
        self.by_key: dict[str, list[ParamSpec]] = {}
        for s in specs:
            self.by_key.setdefault(s.key, []).append(s)
        self._pieces: dict[str, list] = {}
        self._owners: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._ordinal = {k: i for i, k in enumerate(self.by_key)}

    def pieces(self, key: str) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
        """Training pieces of ``key`` over every name storing it: (lo, hi, (tp, pp) shards)."""
        if key not in self._pieces:
            merged: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for spec in self.by_key[key]:
                for iv, shards in self.train.pieces(spec).items():
                    merged.setdefault(iv, []).extend(shards)
            self._pieces[key] = [(lo, hi, tuple(sh)) for (lo, hi), sh in sorted(merged.items())]
        return self._pieces[key]

    def in_replica(self, shards, rep: int) -> list[int]:
        """Holders of ``shards`` in DP replica ``rep`` (an expert shard may have none there)."""
        found = (self.train.shard_rank(sh, rep) for sh in shards)
        return sorted(r for r in found if r is not None)

    def everywhere(self, shards) -> list[int]:
        return sorted(r for sh in shards for r in self.train.shard_ranks(sh))

    def owners(self, key: str, group: int, members: Callable,
               whole_small: bool = False) -> list[tuple[int, int, int]]:
        """Each piece split evenly over ``members(shards)``: [(owner, lo, hi)] (cached per group).
        ``whole_small``: a piece of at most ``WHOLE_PIECE_NUMEL`` elements (a norm) is not
        split; its first member owns it (rows of a few KB split over the members cost a message
        each and balance nothing; all 160 norms of a 70B model are ~2.6 MB in bf16)."""
        if (key, group) not in self._owners:
            out = []
            for lo, hi, shards in self.pieces(key):
                cands = members(shards)
                if (whole_small and cands
                        and (hi - lo) * self.by_key[key][0].row_numel <= WHOLE_PIECE_NUMEL):
                    out.append((cands[0], lo, hi))
                    continue
                k = len(cands)
                for j, h in enumerate(cands):
                    a, b = lo + (hi - lo) * j // k, lo + (hi - lo) * (j + 1) // k
                    if b > a:
                        out.append((h, a, b))
            self._owners[(key, group)] = out
        return self._owners[(key, group)]

    def _rotated_owners(self, key: str, rep: int) -> list[tuple[int, int, int]]:
        """``split``: each piece cut evenly over all its holders, gen replica ``rep`` taking
        part j from holder (j + rep) mod k; a small piece whole from holder (rep + i) mod k, i
        the key's ordinal (so the norms spread over the holders too)."""
        out, i = [], self._ordinal[key]
        for lo, hi, shards in self.pieces(key):
            cands = self.everywhere(shards)
            k = len(cands)
            small = (hi - lo) * self.by_key[key][0].row_numel <= WHOLE_PIECE_NUMEL
            turn = (rep + (i if small else 0)) % k
            cands = cands[turn:] + cands[:turn]
            if small:
                out.append((cands[0], lo, hi))
                continue
            for j, h in enumerate(cands):
                a, b = lo + (hi - lo) * j // k, lo + (hi - lo) * (j + 1) // k
                if b > a:
                    out.append((h, a, b))
        return out

    def held(self, rank: int, key: str) -> list[tuple[int, int]]:
        out = []
        for spec in self.by_key[key]:
            iv = self.train.interval(spec, rank)
            if iv is not None and iv[1] > iv[0]:
                out.append(iv)
        return out

    def _nearest(self, rank: int, key: str, rest) -> list[tuple[int, int, int]]:
        """Rows not held by ``rank``: from a holder in its own DP replica."""
        out, rep = [], self.train.replica(rank)
        for lo, hi, shards in self.pieces(key):
            # an expert another replica's EP rank holds: the holders spread over the receivers
            near = self.in_replica(shards, rep) or self.everywhere(shards)
            src = near[rank % len(near)]
            for a, b in rest:
                out += _clip([(src, lo, hi)], a, b)
        return out

    def sources(self, rank: int, key: str, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """[(src, a, b)] covering [lo, hi) exactly once; src == rank means a local copy."""
        t, g = self.train, self.gen
        if self.strategy == SPLIT:
            return _clip(self._rotated_owners(key, g.replica(rank)), lo, hi)
        if self.strategy == "allgather":
            return _clip(self.owners(key, -1, self.everywhere), lo, hi)
        rep = t.replica(rank)
        if self.strategy == "vanilla":
            return _clip(self.owners(key, rep, lambda sh: self.in_replica(sh, rep)), lo, hi)
        out = [(rank, a, b) for iv in self.held(rank, key) for _, a, b in _clip([(rank, *iv)], lo, hi)]
        rest = _subtract(lo, hi, [(a, b) for _, a, b in out])
        if self.strategy == "zero_redundancy" and rest:
            gt, gp, _ = g.coords[rank]
            group = (rep * g.pp + gp) * g.tp + gt

            def micro_dp(shards):
                return [h for h in self.in_replica(shards, rep) if g.coords[h][:2] == (gt, gp)]

            got = [p for a, b in rest
                   for p in _clip(self.owners(key, group, micro_dp, whole_small=True), a, b)]
            out += got
            rest = [iv for a, b in rest for iv in _subtract(a, b, [(x, y) for _, x, y in got])]
        if rest:
            out += self._nearest(rank, key, rest)
        return out


def choose_strategy(train: Placement, gen: Placement) -> str:
    """What ``strategy="auto"`` runs: ``split`` for disjoint rank sets, ``zero_redundancy``
    when it applies (``zero_redundancy_reason`` is None), else ``p2p`` (the same volume
    whenever both apply, any layout otherwise)."""
    if is_split(train, gen):
        return SPLIT
    return "zero_redundancy" if zero_redundancy_reason(train, gen) is None else "p2p"


def destinations(strategy: str, gen: Placement, specs: Sequence[ParamSpec], rank: int):
    """key -> rows this rank must assemble (gen shard, or the full tensor for the baselines)."""
    out: dict[str, tuple[int, int]] = {}
    for spec in specs:
        if strategy in ("allgather", "vanilla"):
            out.setdefault(spec.key, (0, spec.rows))
            continue
        iv = gen.interval(spec, rank)
        if iv is not None and iv[1] > iv[0]:
            out[spec.key] = iv
    return out


def plan_reshard(
    train: Placement,
    gen: Placement,
    specs: Sequence[ParamSpec],
    strategy: str = "auto",
    bucket_mb: float = 64,
    itemsize: int = 2,
) -> Plan:
    """The full, deterministic plan moving ``specs`` from ``train`` to ``gen`` (module doc).

    ``strategy``: one of ``STRATEGIES``, ``"split"`` or ``"auto"`` (``choose_strategy``);
    ``bucket_mb``: the cap per bucket and rank (MiB); ``itemsize``: bytes per element of the
    training tensors (2: bf16/fp16, 4: fp32). A strategy that does not apply to the placements
    is one ValueError saying why."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    if strategy == "auto":
        strategy = choose_strategy(train, gen)
    src = Sourcer(strategy, train, gen, specs)
    dests = tuple(destinations(strategy, gen, specs, r) for r in range(train.world))
    locs: list[list[tuple[str, int, int]]] = [[] for _ in range(train.world)]
    transfers: list[Transfer] = []
    charges: list[int] = []  # receive bytes a transfer counts for in its destination's bucket
    bucket_bytes = max(1, int(bucket_mb * MiB))
    for key in dict.fromkeys(s.key for s in specs):
        row_bytes = src.by_key[key][0].row_numel * itemsize
        step = max(1, bucket_bytes // row_bytes)
        for r in range(train.world):
            if key not in dests[r]:
                continue
            run, local = [], 0  # this rank's receives of ``key``; bytes of the rows it holds
            for s, a, b in src.sources(r, key, *dests[r][key]):
                if s == r:
                    locs[r].append((key, a, b))
                    local += (b - a) * row_bytes
                    continue
                for c in range(a, b, step):
                    d = min(b, c + step)
                    run.append(Transfer(key, s, r, c, d, (d - c) * row_bytes))
            transfers += run
            charges += [t.nbytes for t in run]
            if run:  # its local rows complete ``key`` with the last receive (reshard.schedule)
                charges[-1] += local
    buckets = _bucket(transfers, charges, bucket_bytes)
    return Plan(strategy, train, gen, tuple(specs), itemsize, bucket_bytes, dests,
                tuple(tuple(x) for x in locs), buckets)


def _bucket(transfers: list[Transfer], charges: list[int],
            cap: int) -> tuple[tuple[Transfer, ...], ...]:
    """Greedy, in order: a new bucket when some rank would send more than ``cap`` or be charged
    (``charges``: receive bytes, plus local rows on a parameter's last receive) more than ``cap``."""
    buckets, cur, recv, sent = [], [], {}, {}
    for t, charge in zip(transfers, charges):
        if cur and (recv.get(t.dst, 0) + charge > cap or sent.get(t.src, 0) + t.nbytes > cap):
            buckets.append(tuple(cur))
            cur, recv, sent = [], {}, {}
        cur.append(t)
        recv[t.dst] = recv.get(t.dst, 0) + charge
        sent[t.src] = sent.get(t.src, 0) + t.nbytes
    if cur:
        buckets.append(tuple(cur))
    return tuple(buckets)
