"""Where each rank's piece of every parameter lives, for a training or a generation layout.

Contract:
- ``Placement`` is a frozen, pure description of one layout of ``world`` ranks: TP size ``tp``,
  PP size ``pp``, and for every rank its ``(tp_rank, pp_rank, replica)`` coordinates, plus the
  rows per TP rank of the vocab-parallel tensors (``vocab_chunk``). It does not need nesting, so it
  describes ANY generation layout (e.g. gen tp > train tp), which ``GenLayout`` cannot.
- ``train_placement(layout, shape)``: megatron's training layout (replica = DP index; vocab padded
  to make_vocab_size_divisible_by * tp, as megatron does).
- ``gen_placement(train, shape, tp, pp, grouping="auto", vocab_pad=None)``: the generation
  layout. ``grouping="auto"`` is ``default_gen_placement``'s choice: ``hybridflow`` when the gen
  shards nest in the training shards (tg | t and pg | p: what the ``zero_redundancy`` strategy
  needs), else ``optimal``. ``grouping="hybridflow"`` / ``"vanilla"`` take the coordinates of ``GenLayout`` (needs tg | t and
  pg | p; replica = dp * dg + micro_dp). ``grouping="consecutive"`` works for any (tg, pg) whose
  product divides the world: with ranks listed in training (dp, pp, tp) order, the i-th gets
  gen_tp = i % tg, gen_pp = (i // tg) % pg, replica = i // (tg * pg). When tg*pg | t*p every gen
  replica lies inside one training DP replica, so every replica does the same work and no rank
  serves more than its share (a plain rank-order placement made some ranks send 2-4x more).
  ``grouping="optimal"`` (any (tg, pg) as well) chooses which rank takes which gen shard so that
  the ranks keep the most of what they hold (``hybridrl.reshard.assignment``): the fewest bytes
  moved by the p2p reshard; ties, and blocks too large to solve, fall back to ``consecutive``.
  ``default_gen_placement`` (and the trainer's rollout worker) use it when the shards do not nest.
  ``vocab_pad=None`` keeps megatron's padded vocab of the TRAINING model split tg ways (not the
  padding of a GPTModel built at tp = tg; what the trainer's builtin engine uses); an int
  (SGLang: 64) pads the real vocab to that multiple first, as SGLang does (``ENGINE_VOCAB_PAD``,
  what the trainer uses with SGLang). Either way a chunk is ceil(padded / tg) rows.
- Split placement (generation ranks apart from training ranks): a ``coords`` entry may be
  ``None``, a rank outside the placement (it holds nothing of it: ``interval`` is None,
  ``replica`` is None). ``split_placements(train, shape, gen_world, tp, pp, vocab_pad)`` puts
  megatron's training layout ``train`` on ranks ``0 .. train.world - 1`` and ``gen_world`` more
  ranks after them for generation, ``tp`` x ``pp`` shards replicated ``gen_world / (tp*pp)``
  times in rank order (the i-th generation rank gets gen_tp = i % tp, gen_pp = (i // tp) % pp,
  replica i // (tp*pp): a gen replica is consecutive ranks, so one node when tp*pp fills it).
  Both placements span all ``train.world + gen_world`` ranks; the planner's ``split`` strategy
  moves weights between them.
- Mixture of experts: a training placement may carry ``ep`` (EP size), ``etp`` (expert TP
  size, 0 = tp) and ``experts`` (per rank: (expert tp rank, EP rank), megatron's expert
  RankGenerator: ``expert_coords``). An expert parameter's rows on a rank are its expert TP
  slice when the rank's EP rank holds the expert, else none; ``pieces`` names its shards
  (expert tp rank, pp rank, EP rank), ``shard_ranks`` / ``shard_rank`` find their ranks (an
  expert shard may have no rank in a given DP replica). Gen placements have ep = 1: every gen
  rank holds every expert, its F cut over gen tp (the engines' layout).
- Nothing here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses

from hybridrl.parallel.layout import GenLayout, TrainLayout
from hybridrl.reshard.assignment import optimal_coords
from hybridrl.reshard.specs import (
    LlamaShape,
    ParamSpec,
    build_specs,
    check_expert_split,
    check_split,
    storage_shape,
)

GROUPINGS = ("auto", "hybridflow", "vanilla", "consecutive", "optimal")

ENGINE_VOCAB_PAD = 64  # SGLang's vocab padding (the builtin engine pads as training does)


@dataclasses.dataclass(frozen=True)
class Placement:
    """tp x pp shards replicated over replicas (module doc); frozen and pure.

    Fields: ``tp``, ``pp``; ``num_layers`` of the model; ``vocab_chunk``, rows per TP rank of
    the vocab-parallel tensors (padding included); ``coords``, one entry per rank of the world:
    ``coords[r] = (tp_rank, pp_rank, replica)`` of rank r, or None for a rank outside this
    placement (the other side of a split); ``grouping``, how the coordinates were chosen
    ("train", "hybridflow", "vanilla", "consecutive", "optimal" or "split").
    """

    tp: int
    pp: int
    num_layers: int
    vocab_chunk: int
    coords: tuple[tuple[int, int, int], ...]
    grouping: str = "train"
    ep: int = 1  # MoE: expert parallel size
    etp: int = 0  # MoE: expert tensor parallel size (0: tp)
    experts: tuple[tuple[int, int], ...] | None = None  # per rank (etp_rank, ep_rank) or None
    _index: dict = dataclasses.field(default=None, repr=False, compare=False)
    _exact: dict = dataclasses.field(default=None, repr=False, compare=False)
    _eindex: dict = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[tuple[int, int], list[int]] = {}
        exact: dict[tuple[int, int, int], int] = {}
        eindex: dict[tuple[int, int, int], list[int]] = {}
        for r, c in enumerate(self.coords):
            if c is None:  # a rank outside this placement (split placement)
                continue
            b, a, rep = c
            if (b, a, rep) in exact:
                raise ValueError(f"ranks {exact[(b, a, rep)]} and {r} share coords {(b, a, rep)}")
            exact[(b, a, rep)] = r
            if not (0 <= b < self.tp and 0 <= a < self.pp):
                raise ValueError(f"rank {r}: coords {(b, a)} outside tp={self.tp}, pp={self.pp}")
            index.setdefault((b, a), []).append(r)
            eb, er = self.expert_coords(r)
            eindex.setdefault((eb, a, er), []).append(r)
        if len(index) != self.tp * self.pp:
            raise ValueError(f"placement leaves some of the tp*pp={self.tp * self.pp} shards empty")
        if len(eindex) != self.expert_tp * self.pp * self.ep:
            raise ValueError(f"placement leaves some of the etp*pp*ep="
                             f"{self.expert_tp * self.pp * self.ep} expert shards empty")
        object.__setattr__(self, "_index", {k: tuple(v) for k, v in index.items()})
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(self, "_eindex", {k: tuple(v) for k, v in eindex.items()})

    @property
    def expert_tp(self) -> int:
        """The TP size each expert's F is cut over (``etp``, or ``tp`` when 0)."""
        return self.etp or self.tp

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(expert TP rank, EP rank) of ``rank`` (without ``experts``: (tp rank, 0))."""
        if self.experts is not None:
            return self.experts[rank]
        return self.coords[rank][0], 0

    def tp_of(self, spec: ParamSpec) -> int:
        """The TP size ``spec`` is cut over here (expert TP for an expert)."""
        return self.tp if spec.expert is None else self.expert_tp

    def local_name(self, spec: ParamSpec) -> str:
        """megatron's name of ``spec`` on its stage and EP rank in this placement."""
        return spec.local_name(self.pp, self.num_layers, self.ep)

    def storage_shape(self, spec: ParamSpec) -> tuple[int, ...]:
        """Shape of megatron's tensor of ``spec`` on one rank of this placement."""
        return storage_shape(spec, self.tp_of(spec), self.vocab_chunk)

    def shard_ranks(self, shard: tuple) -> tuple[int, ...]:
        """Ranks holding a shard of ``pieces``: (tp_rank, pp_rank) or, for an expert,
        (expert tp rank, pp_rank, EP rank)."""
        return self.ranks_at(*shard) if len(shard) == 2 else self._eindex.get(shard, ())

    def shard_rank(self, shard: tuple, replica: int) -> int | None:
        """The rank of ``replica`` holding ``shard`` (None if none does: an expert shard
        another DP replica's EP rank holds)."""
        if len(shard) == 2:
            return self.rank_at(*shard, replica)
        return next((r for r in self.shard_ranks(shard) if self.coords[r][2] == replica), None)

    @property
    def world(self) -> int:
        """Number of ranks the placement spans (members and, in a split, the others)."""
        return len(self.coords)

    def ranks_at(self, tp_rank: int, pp_rank: int) -> tuple[int, ...]:
        """Ranks holding shard (tp_rank, pp_rank), ascending."""
        return self._index[(tp_rank, pp_rank)]

    def rank_at(self, tp_rank: int, pp_rank: int, replica: int) -> int | None:
        """The rank holding shard (tp_rank, pp_rank) in ``replica`` (None if that has no rank)."""
        return self._exact.get((tp_rank, pp_rank, replica))

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of this placement (all of them unless it is one side of a split)."""
        return tuple(r for r, c in enumerate(self.coords) if c is not None)

    def replica(self, rank: int) -> int | None:
        """The replica (training: DP index) ``rank`` belongs to, None outside the placement."""
        c = self.coords[rank]
        return None if c is None else c[2]

    def interval(self, spec: ParamSpec, rank: int) -> tuple[int, int] | None:
        """Canonical rows [lo, hi) that ``rank`` holds of ``spec`` (None: not on its stage, or
        the rank is outside this placement)."""
        if self.coords[rank] is None:
            return None
        b, a, _ = self.coords[rank]
        if not spec.on_stage(self.pp, self.num_layers, a):
            return None
        if spec.expert is not None:
            eb, er = self.expert_coords(rank)
            if er != spec.ep_rank(self.ep):
                return None
            return spec.tp_interval(self.expert_tp, eb)
        return spec.tp_interval(self.tp, b, self.vocab_chunk)

    def pieces(self, spec: ParamSpec) -> dict[tuple[int, int], list[tuple]]:
        """Distinct non-empty pieces of ``spec``: {(lo, hi): [shards]}, a shard being
        (tp_rank, pp_rank), or (expert tp rank, pp_rank, EP rank) for an expert
        (``shard_ranks``)."""
        out: dict[tuple[int, int], list[tuple]] = {}
        for a in range(self.pp):
            if not spec.on_stage(self.pp, self.num_layers, a):
                continue
            if spec.expert is not None:
                for eb in range(self.expert_tp):
                    lo, hi = spec.tp_interval(self.expert_tp, eb)
                    out.setdefault((lo, hi), []).append((eb, a, spec.ep_rank(self.ep)))
                continue
            for b in range(self.tp):
                lo, hi = spec.tp_interval(self.tp, b, self.vocab_chunk)
                if hi > lo:
                    out.setdefault((lo, hi), []).append((b, a))
        return out


def _consecutive(train: TrainLayout, tp: int, pp: int) -> tuple[tuple[int, int, int], ...]:
    """Ranks in training (dp, pp, tp) order; the i-th gets gen (i % tp, (i // tp) % pp, i // (tp*pp))."""
    def key(r):
        c = train.coords(r)
        return c["dp"], c["pp"], c["tp"]

    coords: list = [None] * train.world
    for i, r in enumerate(sorted(range(train.world), key=key)):
        coords[r] = (i % tp, (i // tp) % pp, i // (tp * pp))
    return tuple(coords)


def train_placement(layout: TrainLayout, shape: LlamaShape, ep: int | None = None,
                    etp: int | None = None) -> Placement:
    """megatron's training placement of ``shape`` on ``layout`` (replica = DP index; vocab
    padded to make_vocab_size_divisible_by * tp). ValueError when megatron cannot split the
    shape that way (KV groups or ffn by tp, layers by pp, experts by ep, their F by etp).

    MoE: ``ep`` (default ``layout.ep``) and ``etp`` (default ``layout.etp``, else tp, as
    megatron-core)
    place the experts as megatron's expert RankGenerator does (``expert_coords``); the dense
    DP index (the replica) is then megatron's: the rank's place in its stage // tp."""
    check_split(shape, layout.tp, layout.pp, "train")
    ep = ep or int(getattr(layout, "ep", 1) or 1)
    etp = etp or int(getattr(layout, "etp", 0) or 0) or layout.tp
    check_expert_split(shape, etp, ep, "train")
    world, stage = layout.world, layout.world // layout.pp
    coords, experts = [], None
    for r in range(world):
        c = layout.coords(r)
        coords.append((c["tp"], c["pp"], c["dp"]))
    if shape.num_experts and (ep > 1 or etp != layout.tp):
        experts = expert_coords(world, layout.pp, etp, ep)
        if any(c[1] != r // stage or c[0] != r % layout.tp for r, c in enumerate(coords)):
            raise ValueError(f"ep={ep}, expert tp={etp}: megatron's expert ranks need tp "
                             f"fastest and pp slowest in the layout order (got "
                             f"{getattr(layout, 'order', '?')!r})")
        coords = [(r % layout.tp, r // stage, (r % stage) // layout.tp) for r in range(world)]
    chunk = shape.padded_vocab(layout.tp) // layout.tp
    if experts is None:
        return Placement(layout.tp, layout.pp, shape.layers, chunk, tuple(coords), "train")
    return Placement(layout.tp, layout.pp, shape.layers, chunk, tuple(coords), "train", ep, etp,
                     experts)


def expert_coords(world: int, pp: int, etp: int, ep: int) -> tuple[tuple[int, int], ...]:
    """(expert tp rank, EP rank) of every rank as megatron-core's expert RankGenerator (order
    tp-cp-ep-dp-pp, cp = 1) lays them: within a pipeline stage expert TP varies fastest, then
    EP, then expert DP. ValueError unless etp * ep divides the ranks of a stage."""
    stage = world // pp
    if stage % (etp * ep):
        raise ValueError(f"expert tp x ep = {etp}x{ep} must divide the {stage} ranks of a "
                         f"pipeline stage (world={world}, pp={pp})")
    return tuple(((r % stage) % etp, (r % stage) // etp % ep) for r in range(world))


def gen_placement(
    train: TrainLayout,
    shape: LlamaShape,
    tp: int,
    pp: int = 1,
    grouping: str = "auto",
    vocab_pad: int | None = None,
) -> Placement:
    """The generation placement of ``tp`` x ``pp`` shards on the training ranks (see module doc).

    ``grouping``: one of ``GROUPINGS`` ("auto": hybridflow when the shards nest, else
    optimal); ``vocab_pad``: None for megatron's padding of the training model, or the
    engine's multiple (SGLang: 64)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    if grouping == "auto":
        nested = isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1 and (
            train.tp % tp == 0 and train.pp % pp == 0)
        grouping = "hybridflow" if nested else "optimal"
    if not isinstance(tp, int) or not isinstance(pp, int) or tp < 1 or pp < 1:
        raise ValueError(f"gen tp and pp must be positive integers, got tp={tp!r}, pp={pp!r}")
    check_split(shape, tp, pp, "gen")
    if train.world % (tp * pp):
        raise ValueError(f"gen tp*pp={tp}*{pp} must divide world={train.world}")
    chunk = _gen_vocab_chunk(train, shape, tp, vocab_pad)
    if grouping == "optimal":
        coords = optimal_coords(train_placement(train, shape), build_specs(shape), tp, pp, chunk)
        grouping = "optimal" if coords is not None else "consecutive"
    if grouping == "consecutive":
        coords = _consecutive(train, tp, pp)
    elif grouping != "optimal":
        gen = GenLayout(train, tp=tp, pp=pp, grouping=grouping)  # raises unless tg | t, pg | p
        coords = []
        for r in range(train.world):
            gc = gen.coords(r)
            coords.append((gc.gen_tp, gc.gen_pp, gc.dp * gen.dg + gc.micro_dp))
        coords = tuple(coords)
    return Placement(tp, pp, shape.layers, chunk, coords, grouping)


def default_gen_placement(train: TrainLayout, shape: LlamaShape, tp: int, pp: int = 1,
                          vocab_pad: int | None = None) -> Placement:
    """HybridFlow grouping when the gen shards nest in the training shards, else optimal."""
    nested = train.tp % tp == 0 and train.pp % pp == 0
    return gen_placement(train, shape, tp, pp, "hybridflow" if nested else "optimal", vocab_pad)


def split_placements(train: TrainLayout, shape: LlamaShape, gen_world: int, tp: int, pp: int = 1,
                     vocab_pad: int | None = None) -> tuple[Placement, Placement]:
    """(training, generation) placements over ``train.world + gen_world`` ranks (module doc)."""
    if not isinstance(gen_world, int) or gen_world < 1:
        raise ValueError(f"gen world must be a positive integer, got {gen_world!r}")
    if not isinstance(tp, int) or not isinstance(pp, int) or tp < 1 or pp < 1:
        raise ValueError(f"gen tp and pp must be positive integers, got tp={tp!r}, pp={pp!r}")
    if gen_world % (tp * pp):
        raise ValueError(f"gen tp*pp={tp}*{pp} must divide the generation ranks ({gen_world})")
    check_split(shape, tp, pp, "gen")
    t = train_placement(train, shape)
    chunk = _gen_vocab_chunk(train, shape, tp, vocab_pad)
    gen = tuple((i % tp, (i // tp) % pp, i // (tp * pp)) for i in range(gen_world))
    experts = None if t.experts is None else t.experts + (None,) * gen_world
    return (dataclasses.replace(t, coords=t.coords + (None,) * gen_world, grouping="split",
                                experts=experts),
            Placement(tp, pp, shape.layers, chunk, (None,) * train.world + gen, "split"))


def _gen_vocab_chunk(train: TrainLayout, shape: LlamaShape, tp: int, vocab_pad: int | None) -> int:
    """Rows per gen TP rank of the vocab-parallel tensors (``vocab_pad``: see module doc)."""
    if vocab_pad is not None and (not isinstance(vocab_pad, int) or vocab_pad < 1):
        raise ValueError(f"vocab_pad must be a positive integer or None, got {vocab_pad!r}")
    padded = (shape.padded_vocab(train.tp) if vocab_pad is None
              else -(-shape.vocab // vocab_pad) * vocab_pad)
    return -(-padded // tp)
