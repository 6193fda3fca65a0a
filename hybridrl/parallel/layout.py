"""Pure rank math for the training layout (p x t x d, Megatron order) and the generation layout.

Contract:
- ``TrainLayout`` is a frozen, validated description of N = tp * cp * dp * pp ranks laid out in
  an order string such as Megatron's default ``"tp-cp-ep-dp-pp"`` (leftmost axis varies fastest).
  ``groups(axes)`` returns exactly what megatron-core's ``RankGenerator.get_ranks(axes)`` returns
  for the dense (attention) part: the same groups, in the same order, each listed in the same
  order (the dense generator has ep = 1).
- Experts (MoE layers) are laid out by megatron's second generator over the same N ranks:
  N = etp * ep * edp * pp (``etp``: expert tensor parallel, default tp; ``edp``: expert data
  parallel, derived), cp = 1, same order string. ``expert_groups(axes)`` /
  ``expert_coords(rank)`` are that generator's groups and coordinates. Validation is
  megatron's: etp * ep * pp divides N, and with pp > 1 the order ends in pp or edp == dp.
- ``GenLayout`` derives the generation layout pg x tg x dg x d from a training layout (see
  docs/parallel.md): ``grouping="hybridflow"`` nests every training shard inside its rank's
  generation shard (needs tg | t and pg | p); ``grouping="vanilla"`` is HybridFlow-V, where gen TP
  groups take consecutive training TP ranks.
- ``expert_summary(train)`` / ``expert_lines(train)``: the expert groups (ep, expert tp, expert
  dp) as a JSON-able dict and as the text lines ``hybridrl layout`` prints under the train
  groups.
- Nothing here touches torch.distributed; every function is deterministic, so every rank derives
  the same answer from the same arguments.
- Bad input raises ``ValueError`` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
GROUPINGS = ("hybridflow", "vanilla")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _parse_order(order: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """Order tokens, leftmost fastest; axes of size 1 missing from ``order`` are appended."""
    tokens = tuple(t for t in order.lower().split("-") if t)
    for tok in tokens:
        if tok not in AXES:
            raise ValueError(f"order: unknown token {tok!r} in {order!r}; allowed tokens {AXES}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"order: repeated token in {order!r}")
    for axis in AXES:
        if axis not in tokens and sizes[axis] != 1:
            raise ValueError(f"order: {order!r} omits {axis!r} whose size is {sizes[axis]}")
    return tokens + tuple(a for a in AXES if a not in tokens)


def masked_rank_groups(shape: Sequence[int], mask: Sequence[bool]) -> list[list[int]]:
    """Groups of ranks that vary along the masked axes of a mixed-radix ``shape`` (axis 0 fastest).

    Group ``g`` enumerates the unmasked coordinates in mixed radix (first unmasked axis fastest);
    inside a group, ranks enumerate the masked coordinates the same way. This is the ordering of
    megatron-core's ``generate_masked_orthogonal_rank_groups``.
    """
    strides = [math.prod(shape[:i]) for i in range(len(shape))]
    in_group = [(s, d) for s, d, m in zip(shape, strides, mask) if m]
    across = [(s, d) for s, d, m in zip(shape, strides, mask) if not m]

    def offsets(axes: list[tuple[int, int]]) -> list[int]:
        out = [0]
        for size, stride in axes:  # the first axis ends up fastest
            out = [base + i * stride for i in range(size) for base in out]
        return out

    members = offsets(in_group)
    return [[base + m for m in members] for base in offsets(across)]


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """Training layout: world = tp * cp * dp * pp in ``order`` (dp derived when None); experts:
    world = etp * ep * edp * pp (edp derived)."""

    world: int
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    etp: int | None = None  # expert tensor parallel; None = tp

    def __post_init__(self) -> None:
        _check_positive("world", self.world)
        for name in ("tp", "pp", "cp", "ep"):
            _check_positive(name, getattr(self, name))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _check_positive("etp", self.etp)
        if self.cp != 1:
            raise ValueError(f"cp must be 1 for now, got cp={self.cp}")
        model = self.tp * self.pp * self.cp
        if self.dp is None:
            if self.world % model:
                raise ValueError(
                    f"world={self.world} is not divisible by tp*pp*cp={model} "
                    f"(tp={self.tp}, pp={self.pp}, cp={self.cp})"
                )
            object.__setattr__(self, "dp", self.world // model)
        else:
            _check_positive("dp", self.dp)
            if model * self.dp != self.world:
                raise ValueError(
                    f"tp*pp*dp*cp = {self.tp}*{self.pp}*{self.dp}*{self.cp} = "
                    f"{model * self.dp} must equal world={self.world}"
                )
        expert = self.etp * self.ep * self.pp
        if self.world % expert:
            raise ValueError(
                f"world={self.world} is not divisible by etp*ep*pp = {self.etp}*{self.ep}*"
                f"{self.pp} = {expert} (experts: world = etp*ep*edp*pp)")
        sizes = self.sizes()
        order = "-".join(_parse_order(self.order, {**sizes, "ep": self.ep}))
        object.__setattr__(self, "order", order)
        if self.pp > 1 and not order.endswith("pp") and self.edp != self.dp:
            raise ValueError(
                f"order {order!r} does not end in pp: with pp={self.pp} the expert data-parallel "
                f"size (world/(etp*ep*pp) = {self.edp}) must equal dp={self.dp} (megatron's rule)")
        if self.groups("pp") != self.expert_groups("pp"):  # megatron asserts the same
            raise ValueError(f"order {order!r}: the pipeline groups of the dense and the expert "
                             f"layout differ (tp={self.tp}, etp={self.etp}, ep={self.ep})")

    def sizes(self) -> dict[str, int]:
        """Sizes of the dense (attention) generator: ep is 1 there (megatron's rule)."""
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return self.world // (self.etp * self.ep * self.pp)

    def expert_sizes(self) -> dict[str, int]:
        """Sizes of megatron's expert generator (tp = etp, dp = edp, cp = 1)."""
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    @property
    def expert_shape(self) -> tuple[int, ...]:
        return tuple(self.expert_sizes()[a] for a in self.axes)

    def expert_groups(self, axes: str) -> list[list[int]]:
        """Expert rank groups spanning ``axes`` ("tp" = etp, "ep", "dp" = edp, "tp-ep", ...), as
        megatron's expert RankGenerator gives them."""
        wanted = [a for a in axes.lower().split("-") if a]
        for a in wanted:
            if a not in AXES:
                raise ValueError(f"axes: unknown axis {a!r}; allowed {AXES}")
        return masked_rank_groups(self.expert_shape, [a in wanted for a in self.axes])

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates {axis: index} of a global rank in the expert layout (tp = etp index)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")
        out, rest = {}, rank
        for axis, size in zip(self.axes, self.expert_shape):
            out[axis] = rest % size
            rest //= size
        return out

    def local_experts(self, rank: int, num_experts: int) -> range:
        """Global expert ids held by ``rank``: ep_rank * E/ep + j (megatron's numbering)."""
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={self.ep}")
        per = num_experts // self.ep
        first = self.expert_coords(rank)["ep"] * per
        return range(first, first + per)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes()[a] for a in self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates {axis: index} of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")
        out, rest = {}, rank
        for axis, size in zip(self.axes, self.shape):
            out[axis] = rest % size
            rest //= size
        return out

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing axes are 0)."""
        rank, stride = 0, 1
        for axis, size in zip(self.axes, self.shape):
            idx = coords.get(axis, 0)
            if not 0 <= idx < size:
                raise ValueError(f"{axis} index must be in [0, {size}), got {idx}")
            rank += idx * stride
            stride *= size
        return rank

    def groups(self, axes: str) -> list[list[int]]:
        """All rank groups spanning ``axes`` (e.g. "tp", "dp", "tp-pp"), as RankGenerator gives."""
        wanted = [a for a in axes.lower().split("-") if a]
        for a in wanted:
            if a not in AXES:
                raise ValueError(f"axes: unknown axis {a!r}; allowed {AXES}")
        return masked_rank_groups(self.shape, [a in wanted for a in self.axes])

    def group_of(self, rank: int, axes: str) -> list[int]:
        """The group spanning ``axes`` that contains ``rank``."""
        for group in self.groups(axes):
            if rank in group:
                return group
        raise AssertionError("every rank lies in exactly one group")

    def train_shard(self, rank: int, num_layers: int, num_cols: int) -> Shard:
        """The rank's training shard: PP stage's layer interval x TP slice's column interval."""
        c = self.coords(rank)
        return Shard.of(c["pp"], self.pp, c["tp"], self.tp, num_layers, num_cols)


@dataclasses.dataclass(frozen=True)
class Shard:
    """Half-open index intervals [layer_lo, layer_hi) x [col_lo, col_hi) of a 2-D weight grid."""

    layer_lo: int
    layer_hi: int
    col_lo: int
    col_hi: int

    @staticmethod
    def of(pp_rank: int, pp: int, tp_rank: int, tp: int, num_layers: int, num_cols: int) -> Shard:
        if num_layers % pp or num_cols % tp:
            raise ValueError(
                f"num_layers={num_layers} must be divisible by pp={pp} and "
                f"num_cols={num_cols} by tp={tp}"
            )
        nl, nc = num_layers // pp, num_cols // tp
        return Shard(pp_rank * nl, (pp_rank + 1) * nl, tp_rank * nc, (tp_rank + 1) * nc)

    def contains(self, other: Shard) -> bool:
        return (
            self.layer_lo <= other.layer_lo
            and other.layer_hi <= self.layer_hi
            and self.col_lo <= other.col_lo
            and other.col_hi <= self.col_hi
        )


@dataclasses.dataclass(frozen=True)
class GenCoords:
    """A rank's place in the generation layout."""

    gen_tp: int
    gen_pp: int
    micro_dp: int
    dp: int


@dataclasses.dataclass(frozen=True)
class GenLayout:
    """Generation layout pg x tg x dg x d derived from ``train`` (dg = p*t / (pg*tg))."""

    train: TrainLayout
    tp: int = 1
    pp: int = 1
    grouping: str = "hybridflow"

    def __post_init__(self) -> None:
        _check_positive("gen tp", self.tp)
        _check_positive("gen pp", self.pp)
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        t, p = self.train.tp, self.train.pp
        if t % self.tp:
            raise ValueError(
                f"gen tp={self.tp} must divide train tp={t} for grouping {self.grouping!r} "
                f"(allowed gen tp: {_divisors(t)}); other sizes need the p2p reshard"
            )
        if p % self.pp:
            raise ValueError(
                f"gen pp={self.pp} must divide train pp={p} for grouping {self.grouping!r} "
                f"(allowed gen pp: {_divisors(p)}); other sizes need the p2p reshard"
            )

    @property
    def dg(self) -> int:
        """Micro-DP size: generation replicas carved out of one training replica."""
        return (self.train.tp * self.train.pp) // (self.tp * self.pp)

    @property
    def gen_dp(self) -> int:
        """Total number of generation replicas (dg * d)."""
        return self.dg * self.train.dp

    def coords(self, rank: int) -> GenCoords:
        c = self.train.coords(rank)
        a, b = c["pp"], c["tp"]
        ts, ps = self.train.tp // self.tp, self.train.pp // self.pp  # TP/PP ranks per gen shard
        if self.grouping == "hybridflow":
            gen_tp, gen_pp = b // ts, a // ps
            micro = (a % ps) * ts + b % ts
        else:  # vanilla: consecutive TP (and PP) ranks form a gen group
            gen_tp, gen_pp = b % self.tp, a % self.pp
            micro = (a // self.pp) * ts + b // self.tp
        return GenCoords(gen_tp=gen_tp, gen_pp=gen_pp, micro_dp=micro, dp=c["dp"])

    def _groups_varying(self, field: str) -> list[list[int]]:
        """Ranks sharing every gen coordinate but ``field`` (None: sharing gen tp/pp only)."""
        keep = [f for f in ("gen_tp", "gen_pp", "micro_dp", "dp") if f != field]
        if field == "gen_dp":
            keep = ["gen_tp", "gen_pp"]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.train.world):
            gc = self.coords(r)
            buckets.setdefault(tuple(getattr(gc, f) for f in keep), []).append(r)
        return sorted(sorted(g) for g in buckets.values())

    def tp_groups(self) -> list[list[int]]:
        return self._groups_varying("gen_tp")

    def pp_groups(self) -> list[list[int]]:
        return self._groups_varying("gen_pp")

    def micro_dp_groups(self) -> list[list[int]]:
        return self._groups_varying("micro_dp")

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same generation shard: micro-DP x DP (size dg * d)."""
        return self._groups_varying("gen_dp")

    def gen_shard(self, rank: int, num_layers: int, num_cols: int) -> Shard:
        gc = self.coords(rank)
        return Shard.of(gc.gen_pp, self.pp, gc.gen_tp, self.tp, num_layers, num_cols)


def expert_summary(train: TrainLayout) -> dict:
    """Sizes and (sorted) rank groups of the expert layout."""
    def groups(axes: str) -> list[list[int]]:
        return sorted(sorted(g) for g in train.expert_groups(axes))

    return {"ep_size": train.ep, "etp_size": train.etp, "edp_size": train.edp,
            "ep": groups("ep"), "expt_tp": groups("tp"), "expt_dp": groups("dp")}


def expert_lines(train: TrainLayout, shown: int = 4) -> list[str]:
    """``hybridrl layout``'s lines for the expert layout (``shown`` groups per family)."""
    summary = expert_summary(train)
    lines = [f"expert groups: etp x ep x edp x pp = {train.etp} x {train.ep} x {train.edp} x "
             f"{train.pp} (global expert e lives on ep rank e // (E/ep))"]
    for name in ("ep", "expt_tp", "expt_dp"):
        groups = summary[name]
        more = f", ... ({len(groups)} groups)" if len(groups) > shown else ""
        lines.append(f"  {name:<9} {', '.join(str(g) for g in groups[:shown])}{more}")
    return lines


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
