"""Per-GPU memory of one PPO job, phase by phase, from the model shape and the layouts (pure).

Contract:
- ``MemoryJob`` holds the inputs: ``shape`` (a ``LlamaShape``: Llama 2/3.x, Qwen2/2.5, Qwen3
  with its q/k norms and its own head_dim, Qwen3-MoE), ``world``, training ``tp``/``pp`` (and
  for MoE ``ep`` / ``etp``, 0 = tp: ``hybridrl.planning.moe_memory`` has the expert terms),
  generation ``gen_tp``/``gen_pp``, parameter ``dtype``, the micro-batch (``max_tokens_per_gpu``
  padded tokens of sequences ``seq_len`` long), ``recompute`` (none | selective | full),
  ``sequence_parallel``, the trained roles (``critic``), the reference (``ref``), the distributed
  optimizer (``dist_opt``), what is offloaded (``offload`` subset of params/grads/optim, actor and
  critic; ``params`` also offloads the reference), the rollout (``rollout_seqs`` sequences per
  step), ``gpu_gb``, the rollout ``engine`` (``builtin``: its weights that are the rank's own
  training tensors are not counted twice, ``aliased_bytes``) and the layer ``spec`` (``te``:
  transformer-engine, flash attention, what runs
  on GPU; ``local``: megatron's local spec with hybridrl's lean forwards, what runs on CPU,
  ``hybridrl.models.local_spec``: SDPA attention keeps no [s, s] matrix).
- ``stage_numel(shape, tp, pp, stage, role)``: parameters of one rank of pipeline stage
  ``stage`` (vocab-parallel tensors with megatron's padded vocab; the critic's last stage has a
  [1, h] value head instead of the output layer). Exactly what ``build_model`` allocates;
  ``stage_counts`` also gives the RMSNorm weights among them.
- ``model_state_bytes(job, role, stage)``: ``{"params", "grads", "optim"}`` bytes on one rank:
  params at the model dtype (the local spec keeps RMSNorm weights in fp32), fp32 ``main_grad``
  buffers, optimizer = Adam moments (8 B/param) plus
  fp32 masters for 16-bit models (4 B/param), divided by dp with the distributed optimizer
  (megatron shards the bucket-padded buffer: up to dp*128 elements more per bucket, ignored here);
  expert parameters (E/ep experts, 1/etp of each) are divided by the expert-dp size instead.
- ``activation_bytes(job, stage)``: what one rank of ``stage`` keeps for the backward of the
  micro-batches in flight (1F1B: ``pp - stage`` of them), counted tensor by tensor as megatron's
  layers save them (see ``docs/memory.md``); with full recompute, the layer inputs plus one
  layer's activations while it is recomputed. A MoE layer's MLP terms are the router logits,
  the dispatcher's routed-token buffers and the experts' tensors (``moe_activation_parts``).
  The last stage adds the vocab-parallel log-prob/entropy's peak (``logits_bytes``: the
  logits, the fp32 softmax it saves and the fp32 temporaries of its forward or backward).
- ``job_from_config`` and ``format_report`` (a run config -> ``MemoryJob``; the text table)
  live in ``hybridrl.planning.report``.
- ``plan_memory(job)`` returns the report: per phase (``engine_start``, ``train_actor``,
  ``train_critic``, ``forward_only`` (old log-probs, reference, values, KL-guard forward: one
  model's weights, one layer's activations, the logits' forward peak), ``gen``, ``reshard``,
  ``snapshot`` (with ``kl_guard``: actor and critic weights and optimizer back on the device))
  the bytes on the worst rank by part (a fixed ``reserve`` for the CUDA context,
  NCCL and fragmentation included), the largest phase, and the verdict (``fits``,
  ``headroom_bytes``; or ``overflow``: the phase and by how much). The KV pool
  (``gen_kv_pool_bytes``) follows SGLang 0.5.21's rule (``kv_pool_bytes``): the engine starts
  with F bytes free (the GPU less the reserve and the training parts still resident, phase
  ``engine_start``), its static pool (weights + KV) is ``mem_fraction_static`` x F, so
  KV = mfs x F - weights (< 0: SGLang refuses to start, the job does not fit); the builtin
  engine takes what the gen phase leaves. ``gen_concurrent_seqs`` is how many of a replica's
  sequences it holds at once (the engine runs the rest in waves; the job does not fit when not
  even one sequence does). SGLang's CUDA graphs (``cuda_graph_bytes``: SGLang 0.5.21's own
  reserve of 2 MiB per decode batch size up to ``cuda_graph_max_bs``; 0 = graphs disabled) sit
  outside its static pool and count in ``engine_start`` and ``gen`` only: the adapter starts the
  engine with ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``, so they are released with the rest of the
  engine before training and resumed after the reshard. ``pipeline_bubble`` is (p-1)/(m+p-1) of 1F1B with m micro-batches
  per pipeline per mini-batch (``micro_batches``, ``critic_micro_batches``; absent when 0),
  ``bubble_warning`` when one exceeds 25 % (``bubble_report(pp, micro_batches)``, which the
  trainer's start-up line shares). It also gives the host memory a KL-guard snapshot
  takes per rank (the optimizer shards of actor and critic).
"""

from __future__ import annotations

import dataclasses
import math

from hybridrl.planning.bubble import BUBBLE_WARN, bubble_fraction, bubble_report  # noqa: F401
from hybridrl.planning.moe_memory import (
    check_expert_layout,
    expert_numel,
    moe_activation_parts,
)
from hybridrl.reshard.specs import LlamaShape, build_specs, storage_shape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = ("none", "selective", "full")
SPECS = ("te", "local")
OFFLOADABLE = ("params", "grads", "optim")
GB = 1e9
RESERVE_BYTES = 3 * GB  # CUDA context, NCCL buffers, allocator fragmentation
# bytes per element of the [tokens, vocab/tp] logits slice at the vocab-parallel log-prob's peak
# beyond the logits' own itemsize (hybridrl.models.vocab_parallel, measured on CPU ranks in
# tests/distributed/test_logits_memory.py): the backward holds the saved fp32 softmax, the fp32
# grad, one fp32 temporary and the 16-bit grad of the logits (4 x 4 + itemsize); a forward
# without grad holds the fp32 logits, the softmax and one fp32 product (3 x 4)
LOGITS_TRAIN_FP32, LOGITS_FORWARD_FP32 = 4, 3
# SGLang 0.5.21 reserves this much for its decode CUDA graphs per captured batch size
# (arg_groups/memory_hook.py reserve_for_graph_mb: max_bs * 2 MB)
CUDA_GRAPH_BYTES_PER_BS = 2 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class MemoryJob:
    """The inputs of a memory plan (see the module docstring)."""

    shape: LlamaShape
    world: int
    tp: int = 1
    pp: int = 1
    gen_tp: int = 1
    gen_pp: int = 1
    dtype: str = "bf16"
    max_tokens_per_gpu: int = 16384
    seq_len: int = 4096
    recompute: str = "none"
    sequence_parallel: bool = False
    critic: bool = True
    ref: bool = True
    dist_opt: bool = True
    offload: frozenset = frozenset()
    rollout_seqs: int = 8192
    gpu_gb: float = 80.0
    spec: str = "te"
    reshard_bytes: int = 0  # transient of the train->gen reshard on a rank (hybridrl plan)
    critic_tokens_per_gpu: int = 0  # the critic's micro-batch; 0 = max_tokens_per_gpu
    engine: str = "sglang"  # rollout engine: "builtin" reads the rank's own shards in place
    gen_grouping: str = "hybridflow"  # parallel.gen.grouping (which rank takes which gen shard)
    mem_fraction_static: float = 0.5  # SGLang: its static pool's share of the free memory
    kl_guard: bool = False  # trainer.kl_guard.max_kl > 0: the snapshot phase
    forward_tokens_per_gpu: int = 0  # a forward-only micro-batch; 0 = max_tokens_per_gpu
    micro_batches: int = 0  # per pipeline per mini-batch (actor); 0 = unknown
    critic_micro_batches: int = 0
    cuda_graph_max_bs: int = 512  # SGLang's largest decode graph batch (0: graphs disabled)
    ep: int = 1  # MoE: expert parallel
    etp: int = 0  # MoE: expert tensor parallel (0 = tp)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.engine not in ("builtin", "sglang"):
            raise ValueError(f"engine must be builtin or sglang, got {self.engine!r}")
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}")
        if not set(self.offload) <= set(OFFLOADABLE):
            raise ValueError(f"--offload takes parts of {OFFLOADABLE}, got {sorted(self.offload)}")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"--world {self.world} is not divisible by tp*pp = "
                             f"{self.tp * self.pp}")
        if (self.tp * self.pp) % (self.gen_tp * self.gen_pp):
            raise ValueError(f"gen tp*pp = {self.gen_tp * self.gen_pp} must divide train tp*pp "
                             f"= {self.tp * self.pp}")
        check_expert_layout(self.shape, self.world, self.tp, self.pp, self.ep, self.expert_tp)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sp needs --tp > 1 (sequence parallel splits over the TP group)")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got "
                             f"{self.mem_fraction_static}")
        for name in ("max_tokens_per_gpu", "seq_len", "rollout_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("critic_tokens_per_gpu", "forward_tokens_per_gpu"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: as "
                                 f"--max-tokens-per-gpu), got {getattr(self, name)}")
        if self.seq_len > self.max_tokens_per_gpu:
            raise ValueError(f"--seq-len {self.seq_len} exceeds --max-tokens-per-gpu "
                             f"{self.max_tokens_per_gpu}: one sequence must fit a micro-batch")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel size (megatron: world / (etp * ep * pp))."""
        return self.world // (self.expert_tp * self.ep * self.pp)


def stage_counts(shape: LlamaShape, tp: int, pp: int, stage: int, role: str = "actor",
                 ep: int = 1, etp: int | None = None) -> tuple[int, int]:
    """(all parameters, RMSNorm weights among them) one TP rank of ``stage`` holds (MoE: its
    E/ep experts cut over ``etp``, default tp)."""
    vocab_rows = shape.padded_vocab(tp) // tp
    total, norms = expert_numel(shape, pp, stage, ep, etp or tp), 0
    for spec in build_specs(shape):
        if not spec.on_stage(pp, shape.layers, stage) or getattr(spec, "expert", None) is not None:
            continue
        if spec.name.endswith("mlp.router.weight"):  # replicated, at the model dtype
            total += spec.numel
            continue
        if spec.kind == "vocab" and spec.name == "output_layer.weight" and role == "critic":
            total += shape.hidden  # the value head [1, h], replicated
        elif spec.kind == "vocab":
            total += vocab_rows * spec.row_numel
        elif spec.kind == "norm":
            total, norms = total + spec.numel, norms + spec.numel
        else:
            total += spec.numel // tp
    if role == "critic" and pp == 1 and shape.tied:  # untied: the head is its own tensor
        total += shape.hidden
    return total, norms


def stage_numel(shape: LlamaShape, tp: int, pp: int, stage: int, role: str = "actor",
                ep: int = 1, etp: int | None = None) -> int:
    """Parameters one TP rank of pipeline ``stage`` holds (see the module docstring)."""
    return stage_counts(shape, tp, pp, stage, role, ep, etp)[0]


def model_state_bytes(job: MemoryJob, role: str, stage: int) -> dict[str, int]:
    """params / grads / optim bytes of ``role`` on one rank of ``stage``."""
    n, norms = stage_counts(job.shape, job.tp, job.pp, stage, role, job.ep, job.expert_tp)
    experts = expert_numel(job.shape, job.pp, stage, job.ep, job.expert_tp)
    params = n * job.itemsize
    if job.spec == "local":  # megatron's torch RMSNorm keeps its weight in fp32
        params += norms * (4 - job.itemsize)
    if role == "reference":
        return {"params": params, "grads": 0, "optim": 0}
    per_param = 8 + (4 if job.itemsize < 4 else 0)  # Adam moments (+ fp32 masters)
    optim = ((n - experts) * per_param // job.dp + experts * per_param // job.edp
             if job.dist_opt else n * per_param)
    return {"params": params, "grads": n * 4, "optim": optim}


def _layer_elements_per_token(job: MemoryJob) -> tuple[float, float]:
    """(elements at the activation dtype, fp32 elements) one layer saves per token."""
    s, t = job.shape, job.tp
    h, f, ad, gd = s.hidden, s.ffn, s.heads * s.head_dim, s.num_query_groups * s.head_dim
    rep = h / t if job.sequence_parallel else h  # replicated along TP unless SP splits it
    # Qwen3's per-head q/k RMSNorm keeps its input (local spec: also its fp32 output; TE: rstd)
    qk_norm = (ad + gd) / t if s.qk_norm else 0.0
    if getattr(s, "num_experts", 0):  # the MLP's terms are moe_activation_parts'
        f = 0
    if job.spec == "local":  # hybridrl.models.local_spec, as the layers' saved tensors show
        # norms x 2: input, fp32 rstd and output (the fused CPU RMSNorm, also with its fp32
        # weight under 16-bit activations, keeps no normalized copy; the output is the next
        # linear's saved input); roped q+k heads, the qkv output (v is a view of it), attention
        # output; the fused SwiGLU keeps fc1's output, its product is fc2's saved input
        # (hybridrl.kernels: the eager ops kept 2 more [tokens, f] tensors); q/k norms: counted
        # as their input and fp32 output (an upper bound when fused)
        act = 4 * rep + 8 / job.itemsize + (3 * ad + 3 * gd + 3 * f) / t + 2 * qk_norm
        if job.recompute == "selective":  # core attention recomputed from q, k, v: no lse
            return act, 0.0
        if s.num_query_groups > t and s.heads > s.num_query_groups:
            act += ad / t  # q heads of several groups per rank: SDPA gets a contiguous copy
        return act, s.heads / t  # the attention's log-sum-exp (fp32) per token and head
    # TE: fused norm+linear keep (input, normalized), flash attention keeps q/k/v, output, lse
    act = 4 * rep + (2 * ad + 2 * gd) / t + 3 * f / t + qk_norm
    return act, 2 * s.heads / t  # softmax statistics (fp32) per token and head


def activation_bytes(job: MemoryJob, stage: int, in_flight: int | None = None,
                     tokens: int | None = None, role: str = "actor") -> int:
    """Activation bytes one rank of ``stage`` holds at its peak (see the module docstring);
    ``in_flight`` overrides the number of micro-batches whose activations are alive, ``tokens``
    the micro-batch's padded tokens (default ``max_tokens_per_gpu``); the critic's last stage has
    a value head, no vocabulary logits."""
    tokens = tokens or job.max_tokens_per_gpu
    layers = job.shape.layers // job.pp
    act_item = job.itemsize
    act, fp32 = _layer_elements_per_token(job)
    per_layer = tokens * (act * act_item + fp32 * 4) + _moe_layer(job, tokens)
    in_flight = in_flight or max(job.pp - stage, 1)
    rep = job.shape.hidden / job.tp if job.sequence_parallel else job.shape.hidden
    logits = logits_bytes(job, tokens) if stage == job.pp - 1 and role != "critic" else 0
    if job.recompute == "full":  # layer inputs kept; at the backward's start the logits are
        inputs = tokens * rep * act_item * layers * in_flight  # alive, later one layer's
        return int(inputs + max(logits, per_layer))  # recomputed activations
    return int(per_layer * layers * in_flight + logits)


def _moe_layer(job: MemoryJob, tokens: int) -> int:
    """One MoE layer's router logits, dispatcher buffers and expert tensors (0 when dense)."""
    return sum(moe_activation_parts(job.shape, tokens, 1, job.tp, job.expert_tp,
                                    job.sequence_parallel, job.itemsize, job.spec).values())


def logits_bytes(job: MemoryJob, tokens: int, forward_only: bool = False) -> int:
    """Peak bytes of the vocab-parallel log-prob/entropy on the last stage (the logits slice
    [tokens, V/t] at the activation dtype and its fp32 temporaries, see LOGITS_*)."""
    elems = tokens * job.shape.padded_vocab(job.tp) / job.tp
    if forward_only:
        return int(elems * (LOGITS_FORWARD_FP32 * 4 + job.itemsize))
    return int(elems * (LOGITS_TRAIN_FP32 * 4 + job.itemsize))


def forward_only_bytes(job: MemoryJob, stage: int, role: str) -> int:
    """Activations of a forward without grad: the layer input and one layer's tensors alive at
    once, plus the logits' forward peak on the last stage (not for the critic's value head)."""
    tokens = job.forward_tokens_per_gpu or job.max_tokens_per_gpu
    if role == "critic":  # values: the critic's own micro-batches
        tokens = job.critic_tokens_per_gpu or job.max_tokens_per_gpu
    act, fp32 = _layer_elements_per_token(job)
    layer = tokens * (act * job.itemsize + fp32 * 4 + job.shape.hidden * job.itemsize) \
        + _moe_layer(job, tokens)
    last = stage == job.pp - 1 and role != "critic"
    return int(layer + (logits_bytes(job, tokens, forward_only=True) if last else 0))


def kv_pool_bytes(job: MemoryJob, resident_at_start: int, engine_weights: int) -> int:
    """SGLang's KV pool on a rank whose GPU holds ``resident_at_start`` training bytes when the
    engine starts: mem_fraction_static x (free memory) - weights (negative: no room)."""
    free = job.gpu_gb * GB - RESERVE_BYTES - resident_at_start
    return int(job.mem_fraction_static * free - engine_weights)


def cuda_graph_bytes(job: MemoryJob) -> int:
    """SGLang's CUDA-graph memory on one engine rank (outside its static pool; see the
    module docstring)."""
    if job.engine != "sglang" or job.cuda_graph_max_bs <= 0:
        return 0
    return job.cuda_graph_max_bs * CUDA_GRAPH_BYTES_PER_BS


def _gen_bytes(job: MemoryJob) -> dict[str, int]:
    """Engine weights and the KV cache budget of one rank of a generation replica."""
    s = job.shape
    weights = s.num_params() * job.itemsize // (job.gen_tp * job.gen_pp)
    replicas = job.world // (job.gen_tp * job.gen_pp)
    seqs = -(-job.rollout_seqs // replicas)
    kv_per_token = 2 * (s.layers // job.gen_pp) * (s.num_query_groups * s.head_dim) \
        * job.itemsize / job.gen_tp
    return {"engine_weights": weights, "kv_per_seq": int(kv_per_token * job.seq_len),
            "seqs_per_replica": seqs}


def aliased_bytes(job: MemoryJob, stage: int) -> int:
    """Bytes of the builtin engine's weights that ARE the actor's training tensors on a rank of
    ``stage`` (counted once, as actor params): with gen tp | train tp, gen pp = 1 and the
    hybridflow grouping (each rank's training shard inside its gen shard) the engine keeps each
    gen shard as training-shard parts and reads the rank's own, i.e. every parameter of its
    stage but a tied embedding's output-layer copy (the engine has no lm_head then); with
    another grouping only the (replicated) norms are sure to be the rank's own. Norms count only
    at the model dtype (the local spec keeps them fp32, so a 16-bit engine copies them). 0 for
    SGLang, with offloaded params, or when the shards do not nest."""
    if job.engine != "builtin" or "params" in job.offload or job.gen_pp != 1 \
            or job.tp % job.gen_tp:
        return 0
    chunk = job.shape.padded_vocab(job.tp) // job.tp
    total = 0
    for spec in build_specs(job.shape):
        if (not spec.on_stage(job.pp, job.shape.layers, stage) or spec.tied_copy
                or getattr(spec, "expert", None) is not None):  # experts: counted twice
            continue
        if spec.kind == "norm":
            total += spec.numel if (job.spec != "local" or job.itemsize == 4) else 0
        elif job.gen_grouping == "hybridflow":
            total += math.prod(storage_shape(spec, job.tp, chunk))
    return total * job.itemsize


def _resident(job: MemoryJob, stage: int, active: dict[str, set]) -> dict[str, int]:
    """Bytes of every model part on the device when ``active`` parts are needed."""
    roles = ["actor"] + (["critic"] if job.critic else []) + (["reference"] if job.ref else [])
    out = {}
    for role in roles:
        for part, nbytes in model_state_bytes(job, role, stage).items():
            needed = part in active.get(role, ())
            if nbytes and (needed or part not in job.offload):
                out[f"{role}/{part}"] = nbytes
    return out


def _stage_phases(job: MemoryJob, stage: int, gen: dict) -> tuple[dict, int]:
    """{phase: parts} of one rank of ``stage`` and its KV pool."""
    full = set(OFFLOADABLE)
    weights = gen["engine_weights"] - aliased_bytes(job, stage)
    idle = _resident(job, stage, {})  # what training keeps on the device outside its phases
    if job.engine == "sglang":
        kv = kv_pool_bytes(job, sum(idle.values()), weights)
        engine = {"engine_weights": weights, "kv_pool": max(kv, 0),
                  "cuda_graphs": cuda_graph_bytes(job)}
    else:  # the builtin engine's cache takes what the gen phase leaves
        kv = int(job.gpu_gb * GB - RESERVE_BYTES - sum(idle.values()) - weights)
        engine = {"engine_weights": weights}
    out = {"engine_start": {**idle, **engine},
           "train_actor": {**_resident(job, stage, {"actor": full}),
                           "activations": activation_bytes(job, stage)}}
    if job.critic:
        out["train_critic"] = {
            **_resident(job, stage, {"critic": full}),
            "activations": activation_bytes(job, stage, tokens=job.critic_tokens_per_gpu,
                                            role="critic")}
    roles = ["actor"] + (["reference"] if job.ref else []) + (["critic"] if job.critic else [])
    forwards = [{**_resident(job, stage, {r: {"params"}}),
                 "activations": forward_only_bytes(job, stage, r)} for r in roles]
    out["forward_only"] = max(forwards, key=lambda p: sum(p.values()))
    out["gen"] = {**idle, **engine}
    out["reshard"] = {**_resident(job, stage, {"actor": {"params"}}), "engine_weights": weights,
                      "reshard_transient": job.reshard_bytes}
    if job.kl_guard:
        both = {"params", "optim"}
        out["snapshot"] = _resident(job, stage, {"actor": both, "critic": both})
    return out, kv


def plan_memory(job: MemoryJob) -> dict:
    """The per-phase report (see the module docstring)."""
    cap = int(job.gpu_gb * GB)
    gen = _gen_bytes(job)
    phases: dict[str, dict[str, int]] = {}
    kv = None
    for stage in range(job.pp):
        candidates, stage_kv = _stage_phases(job, stage, gen)
        kv = stage_kv if kv is None else min(kv, stage_kv)
        for name, parts in candidates.items():
            parts = {**parts, "reserve": int(RESERVE_BYTES)}
            if name not in phases or sum(parts.values()) > sum(phases[name].values()):
                phases[name] = {**parts, "stage": stage}
    totals = {name: sum(v for k, v in p.items() if k != "stage") for name, p in phases.items()}
    concurrent = int(min(max(kv // max(gen["kv_per_seq"], 1), 0), gen["seqs_per_replica"]))
    worst = max(totals, key=totals.get)
    snapshot = sum(model_state_bytes(job, role, 0)["optim"]
                   for role in ("actor", "critic") if role == "actor" or job.critic)
    out = {"gpu_bytes": cap, "phases": phases, "totals": totals, "largest_phase": worst,
           "fits": totals[worst] <= cap and concurrent >= 1,
           "headroom_bytes": cap - totals[worst],
           "gen_kv_pool_bytes": max(kv, 0), "gen_kv_bytes_per_seq": gen["kv_per_seq"],
           "gen_concurrent_seqs": concurrent, "gen_seqs_per_replica": gen["seqs_per_replica"],
           "mem_fraction_static": job.mem_fraction_static,
           "kl_guard_snapshot_host_bytes": snapshot, "dp": job.dp}
    if getattr(job.shape, "num_experts", 0):  # one micro-batch through one MoE layer
        out["moe"] = {"ep": job.ep, "etp": job.expert_tp, "edp": job.edp, **moe_activation_parts(
            job.shape, job.max_tokens_per_gpu, 1, job.tp,
            job.expert_tp, job.sequence_parallel, job.itemsize, job.spec)}
    out.update(bubble_report(job.pp, {"actor": job.micro_batches,
                                      "critic": job.critic_micro_batches}))
    if totals[worst] > cap:
        out["overflow"] = {"phase": worst, "bytes": int(totals[worst] - cap)}
    elif concurrent < 1:
        out["overflow"] = {"phase": "gen", "bytes": int(gen["kv_per_seq"] - kv)}
    return out
