"""Parallel, reshard and kernels sections: the two layouts and how weights move between them.

Contract: ``ParallelConfig`` is the training layout (tp, pp, dp, cp = 1, Megatron rank order; for
MoE models ep and etp: megatron's expert layout world = etp*ep*edp*pp over the same ranks, ep
splitting the data-parallel replicas' experts, not multiplying the world) plus the generation
layout ``gen`` (tp, pp, grouping). ``dp = 0`` means "derive from the world
size"; ``resolve_dp(world_size)`` returns dp or raises ``ValueError`` naming the fields. Checks that
need only these numbers run in ``__post_init__``; checks that also need the reshard strategy run in
``HybridRLConfig``. The rank math itself lives in ``hybridrl.parallel``.
"""

from dataclasses import dataclass

from hybridrl.config._fields import check_choice, check_non_negative, check_positive, knob, section

AXES = ("tp", "cp", "ep", "dp", "pp")
GROUPINGS = ("hybridflow", "vanilla")
PLACEMENTS = ("colocated", "split")
RESHARD_STRATEGIES = ("auto", "allgather", "vanilla", "zero_redundancy", "p2p")


@dataclass(frozen=True)
class GenParallelConfig:
    """Generation layout: N = gen.pp*gen.tp*dg*dp with dg = (tp*pp)/(gen.tp*gen.pp) micro-DP."""

    tp: int = knob(1, "Generation tensor-parallel size (tg).")
    pp: int = knob(1, "Generation pipeline-parallel size (pg).")
    grouping: str = knob("hybridflow", "hybridflow (each training shard nested in its "
                         "generation shard; needs gen.tp to divide tp and gen.pp to divide pp) | "
                         "vanilla (HybridFlow-V).")
    world: int = knob(0, "placement=split: ranks that only generate (the last gen.world ranks; "
                      "gen.tp x gen.pp shards replicated over them); 0 with colocated.")

    def __post_init__(self) -> None:
        check_positive("parallel.gen.tp", self.tp)
        check_positive("parallel.gen.pp", self.pp)
        check_non_negative("parallel.gen.world", self.world)
        check_choice("parallel.gen.grouping", self.grouping, GROUPINGS)


@dataclass(frozen=True)
class ParallelConfig:
    """Training layout N = tp*cp*dp*pp (experts: N = etp*ep*edp*pp) and the generation layout
    derived from it."""

    tp: int = knob(1, "Training tensor-parallel size (t).")
    pp: int = knob(1, "Training pipeline-parallel size (p).")
    dp: int = knob(0, "Training data-parallel size (d); 0 = world_size / (tp*pp*cp).")
    cp: int = knob(1, "Context-parallel size (must be 1 for now).")
    ep: int = knob(1, "Expert-parallel size (MoE models): each expert lives on one of ep ranks "
                   "(megatron's expert layout world = etp*ep*edp*pp; ep*etp*pp must divide the "
                   "training world); 1 for dense models.")
    etp: int = knob(0, "Expert tensor-parallel size (MoE models); 0 = parallel.tp.")
    order: str = knob("tp-cp-ep-dp-pp", "Megatron rank order, leftmost axis varies fastest.")
    gen: GenParallelConfig = section(GenParallelConfig, "Generation (rollout) layout.")
    placement: str = knob("colocated", "colocated (every rank trains and generates) | split "
                          "(the last parallel.gen.world ranks generate, the others train; "
                          "weights move train -> gen each step: docs/reshard.md).")

    def __post_init__(self) -> None:
        check_positive("parallel.tp", self.tp)
        check_positive("parallel.pp", self.pp)
        check_non_negative("parallel.dp", self.dp)
        if self.cp != 1:
            raise ValueError(f"parallel.cp must be 1 (not implemented yet); got {self.cp!r}")
        check_positive("parallel.ep", self.ep)
        check_non_negative("parallel.etp", self.etp)
        tokens = self.order.split("-")
        if sorted(tokens) != sorted(AXES):
            raise ValueError("parallel.order must be a '-'-joined permutation of "
                             f"{', '.join(AXES)}; got {self.order!r}")
        check_choice("parallel.placement", self.placement, PLACEMENTS)
        gen_model = self.gen.tp * self.gen.pp
        if self.split:
            if self.gen.world < 1 or self.gen.world % gen_model or self.gen.pp != 1:
                raise ValueError(
                    f"parallel.placement=split needs parallel.gen.world >= 1, a multiple of "
                    f"parallel.gen.tp*parallel.gen.pp ({gen_model}), and parallel.gen.pp = 1; "
                    f"got gen.world={self.gen.world}, gen.pp={self.gen.pp}")
        elif self.gen.world:
            raise ValueError(f"parallel.gen.world={self.gen.world} needs parallel.placement=split "
                             "(colocated: every rank generates)")
        elif (self.tp * self.pp) % gen_model:
            raise ValueError(
                f"parallel.gen.tp*parallel.gen.pp ({self.gen.tp}*{self.gen.pp} = {gen_model}) "
                f"must divide parallel.tp*parallel.pp ({self.tp}*{self.pp} = {self.tp * self.pp})")

    @property
    def split(self) -> bool:
        """True when generation runs on ranks of its own (``placement=split``)."""
        return self.placement == "split"

    def train_world(self, world_size: int) -> int:
        """The training ranks among ``world_size`` (all but the last gen.world when split)."""
        if not self.split:
            return world_size
        if world_size <= self.gen.world:
            raise ValueError(f"parallel.placement=split: world size {world_size} leaves no "
                             f"training rank after parallel.gen.world={self.gen.world}")
        return world_size - self.gen.world

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one dense training replica: tp*pp*cp (ep splits experts inside the
        data-parallel ranks, as megatron does)."""
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (etp; 0 means tp)."""
        return self.etp or self.tp

    @property
    def nested(self) -> bool:
        """True when every training shard lies inside a generation shard (gen.tp | tp, gen.pp | pp)."""
        return not self.split and self.tp % self.gen.tp == 0 and self.pp % self.gen.pp == 0

    @property
    def micro_dp(self) -> int:
        """dg: generation replicas inside one training replica, (tp*pp)/(gen.tp*gen.pp)."""
        return (self.tp * self.pp) // (self.gen.tp * self.gen.pp)

    def resolve_dp(self, world_size: int) -> int:
        """The training DP size for ``world_size`` ranks (derived when dp = 0, else checked)."""
        mp = self.model_parallel_size
        if world_size < 1 or world_size % mp:
            raise ValueError(f"world size {world_size} is not divisible by parallel.tp*pp*cp "
                             f"= {self.tp}*{self.pp}*{self.cp} = {mp}")
        if self.dp and self.dp * mp != world_size:
            raise ValueError(f"parallel.dp = {self.dp} does not fit world size {world_size}: "
                             f"tp*pp*cp*dp = {mp * self.dp}; set parallel.dp={world_size // mp} "
                             "or 0 (derive)")
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            raise ValueError(f"world size {world_size} is not divisible by parallel.etp*ep*pp = "
                             f"{self.expert_tp}*{self.ep}*{self.pp} = {expert} (megatron's "
                             "expert layout)")
        return world_size // mp


@dataclass(frozen=True)
class ReshardConfig:
    """How training weights reach the rollout engine each step."""

    strategy: str = knob("auto", "auto (zero_redundancy when the shards nest, else p2p) | "
                         "allgather | vanilla | zero_redundancy | p2p.")
    bucket_mb: int = knob(256, "Transfer bucket size in MiB (peak transient memory is about "
                          "two buckets).")
    merge_messages: bool = knob(True, "Builtin engine: transfers between two ranks whose tensors "
                                "lie back to back on both sides travel as one message (agreed "
                                "at the first sync; the engine lays its received parts out in "
                                "the senders' memory order).")

    def __post_init__(self) -> None:
        check_choice("reshard.strategy", self.strategy, RESHARD_STRATEGIES)
        check_positive("reshard.bucket_mb", self.bucket_mb)


@dataclass(frozen=True)
class KernelsConfig:
    """Choice between the compiled csrc ops and their pure-torch references."""

    use_compiled: bool | str = knob("auto", "true (fail at start-up if the extension is not "
                                    "built) | false (pure-torch references, via "
                                    "HYBRIDRL_KERNELS=reference) | auto (compiled when built).")

    def __post_init__(self) -> None:
        if not (isinstance(self.use_compiled, bool) or self.use_compiled == "auto"):
            raise ValueError("kernels.use_compiled must be one of true | false | 'auto'; "
                             f"got {self.use_compiled!r}")
