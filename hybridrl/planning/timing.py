"""Predicted seconds of one RL step, phase by phase (pure; ``hybridrl plan --time``).

Contract:
- ``Workload``: what a step does: ``prompts`` per step, ``n`` samples each, mean ``prompt_len``
  and ``response_len``, ``max_response_len``, ``algo`` (``grpo``: no critic; ``gae``: critic),
  ``ppo_epochs``, ``mini_batches`` (optimizer steps per epoch), ``save_freq`` (0: none).
- ``Layout``: ``world``, training ``tp``/``pp``, generation ``gen_tp``/``gen_pp``,
  ``placement`` (``colocated``: every rank generates then trains; ``split``: the last
  ``gen_world`` ranks generate one step ahead while the others train, as ``rollout.async_steps=1``
  runs), training micro-batch budgets (``tokens_per_gpu``, ``critic_tokens_per_gpu``,
  ``forward_tokens_per_gpu``), ``recompute``, ``sp``, ``offload`` parts, ``ref``, ``dtype``,
  ``dist_opt``.
- ``predict(work, lay, hw, mem, reshard)`` -> ``{"step_s", "phases_s", "tokens_per_s_per_gpu",
  "mfu", "mfu_step", "detail"}``. ``mem`` is the ``plan --memory`` report of the ranks that
  train (its ``gen_concurrent_seqs``: the batch an engine holds, from its KV pool; its
  ``phases``' parts: the bytes an offload moves); ``reshard`` is ``{"intra_node_bytes",
  "inter_node_bytes"}`` of the worst rank (colocated, ``planning.traffic``) or
  ``{"busiest_bytes"}`` (split: the weight sync, ``planning.split``). The formulas, each phase a
  physical cost over a peak times one named efficiency (``planning.hardware``):
  * generate: prefill = each prompt's forward FLOPs once (its n samples share it: the builtin
    engine's shared prefill, SGLang's radix cache) over the replica's GPUs (compute-bound);
    decode steps = max_response_len when a replica's sequences all fit its batch C, else
    seqs x response_len / C + (max_response_len - response_len) (continuous batching and its
    tail); one decode step = max(bytes, FLOPs) with bytes = weights M / tg (pg pipeline stages
    each stream their share once per micro-batch) + the batch's KV at the mean context over the
    replica, FLOPs = C tokens' decode FLOPs over the replica; when tg > 1, per forward (the
    prefill's included) 2 all-reduces per layer and ``GEN_EXTRA_COLLECTIVES``; on CPU, per
    forward the layer calls (layers + the head), per token the activation traffic
    (``act_s``) and per request and step the sampling cost (the builtin engine draws each
    request's token with its own generator).
  * old_log_prob / reference / values: forward FLOPs of every sequence (``share_prompts``: a
    packed micro-batch's rows of one prompt compute it once, ``prompt_rows``) over the training
    GPUs, the layer calls and activation traffic (CPU) and the tensor-parallel all-reduces (2
    per layer and micro-batch of tokens x h, ring 2 (t-1)/t, and ``TRAIN_EXTRA_FWD`` small
    ones), all stretched by the 1F1B bubble (m + p - 1) / m; plus pipeline sends
    (``PP_MESSAGES`` per hop and once for the pass's results).
  * actor / critic update: ``ppo_epochs`` x training FLOPs (recompute included), the same
    bubble and TP traffic (x 3: forward, backward, recompute; ``TRAIN_EXTRA_BWD`` more), the
    calls x ``train_calls`` and the activation traffic x ``train_act_ratio`` (CPU), plus per
    mini-batch the distributed optimizer's gradient reduce-scatter (fp32) and parameter
    all-gather over the DP group (NVLink inside a node, InfiniBand when the group spans nodes;
    not overlapped) and the optimizer step: ``OPTIMIZER_BYTES_PER_PARAM`` of the rank's shard
    over HBM (plus a fixed cost per step, measured on CPU).
  * reshard: the plan's bytes on the worst rank, max(inside the node / NVLink, across nodes /
    InfiniBand) (the two links work at once); split: the busiest rank's sync bytes over
    InfiniBand, once per step, on the critical path.
  * offload: the bytes each phase brings to / sends from the device (``PhaseMemory``'s order:
    reshard, gen, old log-prob, reference, values, actor update, critic update; gradients are
    dropped, not copied) over PCIe.
  * checkpoint: params + optimizer shard of each trained role per rank, written at
    ``STORAGE_BPS_PER_NODE`` shared by the node's GPUs, divided by ``save_freq``.
  CPU ranks beyond the machine's cores share them: every compute term x world / cores
  (``share``; waiting in a collective leaves the core to another rank; the calibrated
  collective latency already holds the waits for other ranks). An optimizer step at dp > 1 also
  pays ``DP_STEP_COLLECTIVES`` small all-reduces and (CPU, measured) the distributed
  optimizer's own fixed cost ``dp_step_latency_s``.
  Step: colocated = the sum; split = max(generate, the training phases) + sync.
  ``tokens_per_s_per_gpu`` = prompts x n x (prompt_len + response_len) / step / world; ``mfu`` =
  the actor update's model FLOPs (no recompute) / (its seconds x training GPUs x peak), as verl's
  ``perf/mfu/actor``; ``mfu_step`` = every model FLOP of the step (generation included) /
  (step x world x peak).
- Mean lengths stand for every sequence: attention's L^2 term is under-counted when lengths
  spread (E[L^2] > E[L]^2); rewards and advantages are taken as free.
"""

from __future__ import annotations

import dataclasses
import math

from hybridrl.planning import flops as F
from hybridrl.planning.memory import DTYPE_BYTES, bubble_fraction

STORAGE_BPS_PER_NODE = 5e9  # assumption: a parallel file system's write rate per node
# Adam with fp32 masters per parameter of the rank's shard: reads grad, master, two moments
# (16 B), writes master and moments (12 B) and the 16-bit copy (2 B), zeroes the grad (4 B)
OPTIMIZER_BYTES_PER_PARAM = 34
PHASE_ORDER = ("generate", "reshard", "old_log_prob", "reference", "values", "actor_update",
               "critic_update", "offload", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int
    n: int = 1
    prompt_len: float = 512
    response_len: float = 512
    max_response_len: int = 1024
    algo: str = "grpo"
    ppo_epochs: int = 1
    mini_batches: int = 1
    save_freq: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts", "n", "max_response_len", "ppo_epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if not 0 < self.response_len <= self.max_response_len:
            raise ValueError(f"--response-len must be in (0, --max-response-len "
                             f"{self.max_response_len}], got {self.response_len}")
        if not self.prompt_len > 0:
            raise ValueError(f"--prompt-len must be > 0, got {self.prompt_len}")
        if self.algo not in ("grpo", "gae"):
            raise ValueError(f"--algo must be grpo or gae, got {self.algo!r}")
        if self.save_freq < 0:
            raise ValueError(f"--save-freq must be >= 0, got {self.save_freq}")

    @property
    def seqs(self) -> int:
        return self.prompts * self.n

    @property
    def length(self) -> float:
        return self.prompt_len + self.response_len

    @property
    def critic(self) -> bool:
        return self.algo == "gae"


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    gen_tp: int = 1
    gen_pp: int = 1
    placement: str = "colocated"
    gen_world: int = 0
    tokens_per_gpu: int = 16384
    critic_tokens_per_gpu: int = 0
    forward_tokens_per_gpu: int = 0
    recompute: str = "none"
    sp: bool = False
    offload: frozenset = frozenset()
    ref: bool = True
    dtype: str = "bf16"
    dist_opt: bool = True
    share_prompts: bool = False  # packed micro-batches compute a shared prompt once

    @property
    def train_world(self) -> int:
        return self.world - self.gen_world if self.placement == "split" else self.world

    @property
    def dp(self) -> int:
        return self.train_world // (self.tp * self.pp)

    @property
    def gen_replicas(self) -> int:
        ranks = self.gen_world if self.placement == "split" else self.world
        return ranks // (self.gen_tp * self.gen_pp)


def _ring(bytes_: float, group: int, bps: float, latency: float) -> float:
    """A ring all-reduce of ``bytes_`` over ``group`` ranks (reduce-scatter + all-gather) and
    the fixed latency of one collective."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * bytes_ / bps + latency


def _link(hw, group_span: int) -> float:
    """Usable bytes/s of a group whose ranks span ``group_span`` consecutive ranks."""
    bps = hw.nvlink_bps if group_span <= hw.gpus_per_node else hw.ib_bps
    return bps * hw.eff("link")


def micro_batches(work: Workload, lay: Layout, budget: int) -> int:
    """Micro-batches per pipeline per mini-batch: the rank's sequences of one mini-batch in
    budgets of ``budget`` tokens (at least pp when there are that many sequences)."""
    seqs = max(work.seqs / (work.mini_batches * lay.dp), 1.0)
    per = max(budget // max(int(work.length), 1), 1)
    return max(math.ceil(seqs / per), min(lay.pp, math.ceil(seqs)))


def share(hw, lay: Layout) -> float:
    """How much longer a rank's compute runs when the ranks outnumber the cores they share
    (CPU: ``hw.cores``; every rank of the job counts, split placement's two sides included; a
    rank waiting in a collective leaves its core to another): world / cores, at least 1; 1
    with a device per rank."""
    return max(1.0, lay.world / hw.cores) if hw.cores else 1.0


def act_s(hw, shape, tokens: float, head_tokens: float, itemsize: int, layers: float,
          ratio: float = 1.0) -> float:
    """Seconds of the activation traffic beyond the GEMMs: ``hw.act_passes`` hidden-sized
    vectors per token and layer and vocab-sized ones per token through the head, x ``ratio``
    (a training pass's over a forward's), at the memory bandwidth."""
    if not hw.act_passes:
        return 0.0
    vectors = tokens * layers * shape.hidden + head_tokens * shape.vocab
    return ratio * hw.act_passes * vectors * itemsize / (hw.hbm_bps * hw.eff("hbm"))


# the collectives of one generation forward at gen tp > 1 beyond 2 per layer: the vocab-parallel
# embedding's all-reduce, the last position's logits all-gathered, the sampled tokens broadcast
GEN_EXTRA_COLLECTIVES = 3
# a training forward's beyond 2 per layer: the vocab-parallel embedding's all-reduce (first
# stage) and the vocab-parallel log-prob's 4 (max, sum of exponentials, target logit, entropy:
# last stage); its backward's: the output layer's input gradient; a critic's value head: none
TRAIN_EXTRA_FWD = {"actor": 4, "critic": 0}
TRAIN_EXTRA_BWD = {"actor": 1, "critic": 0}
# an optimizer step's small DP collectives: the loss normalizers' global token and sequence
# counts (hybridrl.algos.agg.compute_agg_normalizers: a SUM and a MAX)
DP_STEP_COLLECTIVES = 2
# a pipeline hop's messages: megatron's variable_seq_lengths sends the shape first; the last
# stage's results of each forward_backward call (its outputs, the loss's metrics) go to the
# other stages the same way: a size, then the payload
PP_MESSAGES = 2


def prompt_rows(work: Workload, lay: Layout, budget: int) -> float:
    """Sequences of a micro-batch that share one computation of their prompt: with
    ``share_prompts``, a micro-batch's ``b`` sequences hold ceil(b / n) prompt groups (the
    trainer keeps a prompt's n rows together), else 1."""
    if not lay.share_prompts or work.n == 1:
        return 1.0
    b = max(budget // max(int(work.length), 1), 1)
    return b / math.ceil(b / work.n)


def generate_s(work: Workload, lay: Layout, hw, shape, concurrent: int) -> tuple[float, dict]:
    """Seconds of the rollout on one replica (every replica in parallel) and its parts."""
    g = lay.gen_tp * lay.gen_pp
    itemsize = DTYPE_BYTES[lay.dtype]
    per_replica = math.ceil(work.seqs / lay.gen_replicas)
    unique = math.ceil(per_replica / work.n)  # the n samples of a prompt are prefilled once
    batch = max(min(concurrent, per_replica), 1)
    peak = hw.flops * hw.eff("matmul")
    busy = share(hw, lay)  # compute stretches when ranks share cores; waiting does not
    calls = (shape.layers + 1) * hw.kernel_latency_s  # one forward's layer calls and the head
    prefill = (unique * F.forward_flops(shape, work.prompt_len) / (g * peak) + calls
               + act_s(hw, shape, unique * work.prompt_len, unique, itemsize,
                       shape.layers / lay.gen_pp)) * busy
    if per_replica <= batch:
        steps = work.max_response_len
    else:
        steps = per_replica * work.response_len / batch + work.max_response_len \
            - work.response_len
    context = work.prompt_len + work.response_len / 2
    weights = shape.num_params() * itemsize / lay.gen_tp
    kv = batch * context * F.kv_bytes_per_token(shape, itemsize) / g
    bytes_s = (weights + kv) / (hw.hbm_bps * hw.eff("hbm"))
    flops_s = batch * F.decode_token_flops(shape, context) / (g * peak)
    step = (max(bytes_s, flops_s) + calls + batch * hw.sample_latency_s
            + act_s(hw, shape, batch, batch, itemsize, shape.layers / lay.gen_pp)) * busy
    if lay.gen_tp > 1:
        link = _link(hw, lay.gen_tp)
        msg = batch / lay.gen_pp * shape.hidden * itemsize
        extra = GEN_EXTRA_COLLECTIVES * hw.collective_latency_s
        step += 2 * shape.layers * _ring(msg, lay.gen_tp, link, hw.collective_latency_s) + extra
        prompt_msg = unique * work.prompt_len * shape.hidden * itemsize
        prefill += 2 * shape.layers * _ring(prompt_msg, lay.gen_tp, link,
                                            hw.collective_latency_s) + extra
    return prefill + steps * step, {
        "prefill_s": prefill, "decode_steps": steps, "decode_step_s": step,
        "batch": batch, "decode_bound": "hbm" if bytes_s >= flops_s else "compute"}


def _pass_s(work: Workload, lay: Layout, hw, shape, role: str, train: bool, budget: int) -> float:
    """One pass over the step's sequences (a forward, or ``ppo_epochs`` updates)."""
    itemsize = DTYPE_BYTES[lay.dtype]
    n = lay.train_world
    peak = hw.flops * hw.eff("matmul")
    length, rows = work.length, prompt_rows(work, lay, budget)
    fwd = F.shared_forward_flops(shape, work.prompt_len, length, rows, role)
    if train:  # recompute turns prompt sharing off (the trainer's rule): rows = 1 there
        flops = work.ppo_epochs * work.seqs * (F.train_flops(shape, length, role, lay.recompute)
                                               - 3 * (F.forward_flops(shape, length, role) - fwd))
    else:
        flops = work.seqs * fwd
    m = micro_batches(work, lay, budget)
    stretch = 1 / (1 - bubble_fraction(lay.pp, m))
    # per rank: micro-batches it runs in this pass, each through layers / pp layers
    epochs = work.ppo_epochs if train else 1
    micro = m * work.mini_batches * epochs
    passes = (3 if lay.recompute == "full" else 2) if train else 1
    shared = F.shared_tokens(work.prompt_len, length, rows)  # a sequence's tokens computed
    tokens = min(budget, work.seqs * length / (work.mini_batches * lay.dp)) * shared / length
    layers = shape.layers / lay.pp
    rank_tokens = epochs * work.seqs * shared / lay.dp  # a stage's tokens (every TP rank's)
    act = act_s(hw, shape, rank_tokens, rank_tokens if role != "critic" else 0.0, itemsize,
                layers, hw.train_act_ratio if train else 1.0)
    calls = micro * (layers + 1) * (hw.train_calls if train else 1.0) * hw.kernel_latency_s
    tp_comm = 0.0
    if lay.tp > 1:
        msg = tokens * shape.hidden * itemsize
        # the embedding's on the first stage, the head's on the last: the larger per stage
        fwd = TRAIN_EXTRA_FWD[role]
        extra = 1 + fwd if lay.pp == 1 else max(fwd, 1)
        if train:
            extra = extra * (passes - 1) + TRAIN_EXTRA_BWD[role]  # recompute: the forward's again
        tp_comm = micro * (layers * 2 * passes * _ring(msg, lay.tp, _link(hw, lay.tp),
                                                       hw.collective_latency_s)
                           + extra * hw.collective_latency_s)
    busy = share(hw, lay)  # compute stretches when ranks share cores; waiting does not
    stage = ((flops / (n * peak) + act + calls) * busy + tp_comm) * stretch
    pp_comm = 0.0
    if lay.pp > 1:
        act_bytes = tokens * shape.hidden * itemsize / (lay.tp if lay.sp else 1)
        hops = micro * (2 if train else 1)  # activations forward, their gradients back
        # each hop: the tensor's shape first (packed micro-batches vary in length), then it
        pp_comm = hops * (act_bytes / _link(hw, lay.tp * lay.dp * 2)
                          + PP_MESSAGES * hw.collective_latency_s) \
            + epochs * work.mini_batches * PP_MESSAGES * hw.collective_latency_s
    dp_comm = optimizer = 0.0
    if train:
        from hybridrl.planning.memory import stage_numel

        params = max(stage_numel(shape, lay.tp, lay.pp, s, role) for s in range(lay.pp))
        shard = params / lay.dp if lay.dist_opt else params
        optimizer = work.mini_batches * work.ppo_epochs * (
            hw.optimizer_latency_s + shard * OPTIMIZER_BYTES_PER_PARAM
            / (hw.hbm_bps * hw.eff("hbm")))
    if train and lay.dp > 1:
        link = _link(hw, lay.tp * lay.dp)
        if lay.dist_opt:  # reduce-scatter fp32 grads + all-gather params: one ring each
            sync = _ring(params * (4 + itemsize) / 2, lay.dp, link, hw.collective_latency_s) \
                + hw.collective_latency_s
        else:
            sync = _ring(params * 4, lay.dp, link, hw.collective_latency_s)
        sync += DP_STEP_COLLECTIVES * hw.collective_latency_s + hw.dp_step_latency_s * busy
        dp_comm = work.mini_batches * work.ppo_epochs * sync
    return stage + pp_comm + dp_comm + optimizer * busy


PHASE_NEEDS = (  # PhaseMemory's phases in a step and the parts each brings to the device
    ("reshard", {"actor": {"params"}}), ("gen", {}), ("old_log_prob", {"actor": {"params"}}),
    ("reference", {"reference": {"params"}}), ("values", {"critic": {"params"}}),
    ("actor_update", {"actor": {"params", "optim"}}),
    ("critic_update", {"critic": {"params", "optim"}}))


def offload_bytes(lay: Layout, mem: dict, critic: bool) -> float:
    """Bytes one rank copies to or from host memory per step (see the module docstring)."""
    parts = mem["phases"]["train_actor"], mem["phases"].get("train_critic", {})
    size = {("actor", "params"): parts[0].get("actor/params", 0),
            ("actor", "optim"): parts[0].get("actor/optim", 0),
            ("critic", "params"): parts[1].get("critic/params", 0),
            ("critic", "optim"): parts[1].get("critic/optim", 0),
            ("reference", "params"): mem["phases"]["forward_only"].get("reference/params", 0)}
    if not size[("reference", "params")]:  # forward_only kept the actor's: same stage size
        size[("reference", "params")] = size[("actor", "params")]
    roles = {"actor"} | ({"reference"} if lay.ref else set()) | ({"critic"} if critic else set())
    phases = [(p, need) for p, need in PHASE_NEEDS if all(r in roles for r in need)
              and not (lay.placement == "split" and p in ("reshard", "gen"))]
    moved = 0.0
    for i, (_, need) in enumerate(phases):
        before = phases[i - 1][1]
        for role in roles:
            for part in ("params", "optim"):
                if part not in lay.offload:
                    continue
                was, now = part in before.get(role, ()), part in need.get(role, ())
                if was != now:
                    moved += size.get((role, part), 0)
    return moved


def predict(work: Workload, lay: Layout, hw, shape, mem: dict, reshard: dict) -> dict:
    """The step's phases in seconds and its throughput (see the module docstring)."""
    if lay.placement == "split" and not 0 < lay.gen_world < lay.world:
        raise ValueError(f"--gen-world must be in 1 .. world-1, got {lay.gen_world}")
    gen, gen_detail = generate_s(work, lay, hw, shape, mem["gen_concurrent_seqs"])
    budget_f = lay.forward_tokens_per_gpu or lay.tokens_per_gpu
    budget_c = lay.critic_tokens_per_gpu or lay.tokens_per_gpu
    phases = {"generate": gen}
    if lay.placement == "split":
        phases["reshard"] = reshard["busiest_bytes"] / (hw.ib_bps * hw.eff("link"))
    else:
        phases["reshard"] = max(reshard["intra_node_bytes"] / (hw.nvlink_bps * hw.eff("link")),
                                reshard["inter_node_bytes"] / (hw.ib_bps * hw.eff("link")))
    phases["old_log_prob"] = _pass_s(work, lay, hw, shape, "actor", False, budget_f)
    phases["reference"] = _pass_s(work, lay, hw, shape, "actor", False, budget_f) \
        if lay.ref else 0.0
    phases["values"] = _pass_s(work, lay, hw, shape, "critic", False, budget_c) \
        if work.critic else 0.0
    phases["actor_update"] = _pass_s(work, lay, hw, shape, "actor", True, lay.tokens_per_gpu)
    phases["critic_update"] = _pass_s(work, lay, hw, shape, "critic", True, budget_c) \
        if work.critic else 0.0
    moved = offload_bytes(lay, mem, work.critic)
    phases["offload"] = moved / (hw.pcie_bps * hw.eff("pcie"))
    ckpt = 0.0
    if work.save_freq:
        a, c = mem["phases"]["train_actor"], mem["phases"].get("train_critic", {})
        per_rank = a.get("actor/params", 0) + a.get("actor/optim", 0) \
            + c.get("critic/params", 0) + c.get("critic/optim", 0)
        ckpt = per_rank * min(hw.gpus_per_node, lay.train_world) / STORAGE_BPS_PER_NODE \
            / work.save_freq
    phases["checkpoint"] = ckpt
    train_side = sum(v for k, v in phases.items() if k not in ("generate", "reshard"))
    if lay.placement == "split":
        step = max(gen, train_side) + phases["reshard"]
    else:
        step = sum(phases.values())
    peak = hw.flops
    actor_model = work.ppo_epochs * work.seqs * F.model_flops(shape, work.length)
    mfu = actor_model / (phases["actor_update"] * lay.train_world * peak) \
        if phases["actor_update"] else 0.0
    forwards = work.seqs * F.forward_flops(shape, work.length) * (1 + lay.ref)
    critic_model = 0.0
    if work.critic:
        critic_model = work.seqs * (F.forward_flops(shape, work.length, "critic")
                                    + work.ppo_epochs * F.model_flops(shape, work.length,
                                                                      "critic"))
    gen_model = work.seqs * (F.forward_flops(shape, work.prompt_len)
                             + work.response_len * F.decode_token_flops(
                                 shape, work.prompt_len + work.response_len / 2))
    mfu_step = (actor_model + forwards + critic_model + gen_model) / (step * lay.world * peak)
    return {"step_s": step, "phases_s": phases,
            "tokens_per_s_per_gpu": work.seqs * work.length / step / lay.world,
            "mfu": mfu, "mfu_step": mfu_step,
            "detail": {"generate": gen_detail, "offload_bytes": moved,
                       "micro_batches": micro_batches(work, lay, lay.tokens_per_gpu),
                       "pipeline_bubble": bubble_fraction(
                           lay.pp, micro_batches(work, lay, lay.tokens_per_gpu))}}
