"""Build the actor, critic, reference and reward model as megatron-core GPTModel stages here.

Contract:
- ``build_model(spec, groups, role, dtype=..., seed=...)`` returns a ``ShardedModel``: this rank's
  pipeline stage (``groups.pp_rank``) and TP slice (``groups.tp_rank``) of a llama-family GPTModel
  built from ``spec`` (see ``hybridrl.models.spec``). Every rank of the layout must call it with
  the same arguments (construction of a tied model with pp > 1 does one collective).
- roles: ``"actor"`` (logits head, trainable), ``"critic"`` (same trunk; the last stage's output
  layer is a replicated scalar ``ValueHead``, embeddings never tied), ``"reference"`` (actor
  architecture, frozen: ``requires_grad`` False, eval mode, no optimizer), ``"reward"`` (critic
  architecture, frozen like the reference: a reward model). Trainable roles are
  wrapped in megatron-core's DistributedDataParallel (``ShardedModel.ddp``: fp32 ``main_grad``
  buffers, gradients averaged over ``groups.dp`` by ``finalize_model_grads``). At dp = 1 there
  is no reduction or gather to overlap: ``overlap_grad_reduce`` / ``overlap_param_gather`` are
  dropped (``ShardedModel.ddp_options`` holds what is used), which spares megatron's per-module
  forward pre-hooks and per-parameter bucket bookkeeping (~5% of a CPU training micro-batch).
- Layer spec: transformer-engine when CUDA is available and ``transformer_engine`` imports, else
  megatron's local spec with hybridrl's lean forwards (``local_spec``: SDPA core attention, one
  RoPE pass over q and k, ``F.linear``, also for the output layer; same parameters and
  numerics). On CPU ``cpu_compat.install()`` runs first (the only CPU workaround site).
- Initialization is seeded: the same seed and layout give the same weights (so an actor, its
  reference and its critic's trunk start equal). Different layouts initialize differently (each
  stage draws its layers from the seed); load a checkpoint to compare layouts.
- ``ensure_megatron_state(groups)`` hands the groups to megatron (``apply_megatron_groups``) when
  they are not installed (again, e.g. after ``clear_megatron_groups``); building and every
  ``forward.run_microbatches`` call it.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridrl.models import cpu_compat
from hybridrl.models.spec import LlamaSpec, check_layout, padded_vocab_size, to_transformer_config

ROLES = ("actor", "critic", "reference", "reward")
VALUE_ROLES = ("critic", "reward")  # scalar value head instead of the logits
FROZEN_ROLES = ("reference", "reward")  # no gradients, no optimizer


@dataclasses.dataclass(frozen=True)
class DDPOptions:
    """How megatron's DDP holds and reduces a trained model's gradients (and parameters)."""

    use_distributed_optimizer: bool = True  # optimizer state + fp32 masters sharded over DP
    overlap_grad_reduce: bool = False  # reduce buckets during the backward (GPU)
    overlap_param_gather: bool = False  # gather updated params during the next forward (GPU)
    bucket_size: int | None = None  # elements per bucket; None = megatron's default

    def __post_init__(self) -> None:
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather needs use_distributed_optimizer=True (only "
                             "the distributed optimizer gathers parameters)")


@dataclasses.dataclass
class ShardedModel:
    """One rank's stage/slice of a model plus everything needed to run and convert it."""

    role: str
    module: torch.nn.Module  # megatron GPTModel (this stage only)
    spec: LlamaSpec
    groups: object  # hybridrl ParallelGroups
    pg_collection: object  # megatron ProcessGroupCollection of the same groups
    config: object  # megatron TransformerConfig
    padded_vocab_size: int
    dtype: str
    uses_te: bool
    ddp: torch.nn.Module | None = None  # megatron DDP around ``module`` (trainable roles)
    ddp_options: DDPOptions = DDPOptions()

    @property
    def schedule_module(self) -> torch.nn.Module:
        """What the pipeline schedule runs: the DDP wrapper when there is one."""
        return self.ddp if self.ddp is not None else self.module

    @property
    def vocab_start(self) -> int:
        """First (padded) vocab id of this TP rank's slice."""
        return self.groups.tp_rank * self.padded_vocab_size // self.groups.tp_size

    @property
    def layers_per_stage(self) -> int:
        return self.spec.num_layers // self.groups.pp_size

    @property
    def layer_offset(self) -> int:
        """Global index of this stage's first layer."""
        return self.groups.pp_rank * self.layers_per_stage

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device


class ValueHead(torch.nn.Module):
    """Scalar value per token, replicated on every TP rank; called like megatron's output layer.
    With sequence parallelism (``sp_group``: the TP group) it first gathers the sequence; every
    TP rank then computes the same values, so the backward keeps its own slice of the grad."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, std: float, seed: int,
                 sp_group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))  # [1, H]
        generator = torch.Generator().manual_seed(seed)  # the same head for every layout
        torch.nn.init.normal_(self.weight, mean=0.0, std=std, generator=generator)
        self.sequence_parallel, self.sp_group = False, sp_group

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sp_group is not None:  # [S/tp, B, H] -> [S, B, H]
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_SBH = gather_from_sequence_parallel_region(
                hidden_SBH, tensor_parallel_output_grad=False, group=self.sp_group)
        return torch.nn.functional.linear(hidden_SBH, self.weight), None  # [S, B, 1]


def transformer_engine_available() -> bool:
    """True when the TE layer spec is used: CUDA is available and transformer_engine imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(use_te: bool, qk_norm: bool = False, num_experts: int = 0):
    """megatron-core layer spec for a llama layer: TE's fused modules, else megatron's local
    modules with hybridrl's lean forwards (``hybridrl.models.local_spec``); ``qk_norm``: Qwen3's
    per-head q/k RMSNorm (megatron's ``q_layernorm`` / ``k_layernorm``); ``num_experts`` > 0:
    the MLP is megatron's MoELayer (router, alltoall dispatcher, experts: TE grouped GEMM with
    TE, else SequentialMLP)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = num_experts or None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=qk_norm)
    from hybridrl.models.local_spec import local_layer_spec

    return local_layer_spec(qk_layernorm=qk_norm, num_experts=num_experts)


def install_rope(module, spec: LlamaSpec) -> None:
    """Give a GPTModel's RoPE transformers' inverse frequencies for a scaled RoPE (llama3 with
    any keys, yarn; megatron's own llama3 scaling hard-codes low/high_freq_factor 1/4 and an
    8192 context, and megatron has no yarn for GPTModel). Plain RoPE keeps megatron's own."""
    if spec.rope_scaling is None:
        return
    from hybridrl.models.rope import inv_freq

    freq, _ = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                       spec.max_position_embeddings)
    rotary = module.rotary_pos_emb
    rotary.inv_freq = freq.to(rotary.inv_freq.device)


def ensure_megatron_state(groups):
    """Install ``groups`` into megatron's parallel_state (and its global memory buffer) unless
    they already are; returns the ProcessGroupCollection. Cheap when nothing changed."""
    cpu_compat.install()
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.megatron import apply_megatron_groups, to_process_group_collection

    installed = ps._TENSOR_MODEL_PARALLEL_GROUP is groups.tp
    pgc = (to_process_group_collection(groups) if installed and
           ps._PIPELINE_MODEL_PARALLEL_GROUP is groups.pp else apply_megatron_groups(groups))
    if ps._GLOBAL_MEMORY_BUFFER is None:  # scratch space of the local attention's baddbmm
        ps._set_global_memory_buffer()
    return pgc


def _seed(seed: int, groups) -> None:
    torch.manual_seed(seed)
    tp_rank, ep_rank, etp_rank = groups.tp_rank, groups.ep_rank, groups.etp_rank
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank,
                                        etp_rank=etp_rank)
    else:
        cpu_compat.seed_cpu_rng_tracker(seed, tp_rank, ep_rank, etp_rank)


def build_model(
    spec: LlamaSpec, groups, role: str = "actor", *, dtype: str = "fp32", seed: int = 1,
    ddp_options: DDPOptions | None = None, **config_overrides,
) -> ShardedModel:
    """This rank's stage of the ``role`` model for ``spec`` on ``groups.train``."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    check_layout(spec, groups.train)
    cpu_compat.install()
    pgc = ensure_megatron_state(groups)
    config = to_transformer_config(spec, groups.train, dtype, **config_overrides)
    if groups.pp_size > 1:
        config.variable_seq_lengths = True  # micro-batches may differ in [B, T]
    use_te = transformer_engine_available()
    if spec.is_moe:  # megatron's per-process aux-loss log is sized by the first model's layers
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    vocab = padded_vocab_size(spec.vocab_size, groups.tp_size)
    _seed(seed, groups)
    moe = {"num_experts": spec.num_experts} if spec.is_moe else {}  # dense: the call of before
    with cpu_compat.cpu_model_construction():
        module = GPTModel(
            config, layer_spec(use_te, spec.qk_norm, **moe), vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=groups.is_first_stage, post_process=groups.is_last_stage,
            share_embeddings_and_output_weights=(spec.tie_word_embeddings
                                                 and role not in VALUE_ROLES),
            position_embedding_type="rope", rotary_base=int(spec.rope_theta)
            if float(spec.rope_theta).is_integer() else spec.rope_theta,
            pg_collection=pgc,
        )
    install_rope(module, spec)
    zero_vocab_padding(module, spec.vocab_size, vocab, groups)
    if role in VALUE_ROLES and groups.is_last_stage:
        module.output_layer = ValueHead(spec.hidden_size, config.params_dtype,
                                        config.init_method_std, seed,
                                        groups.tp if config.sequence_parallel else None)
    if not use_te:
        from hybridrl.models.local_spec import make_output_layer_lean

        make_output_layer_lean(module)
    if torch.cuda.is_available():
        module.cuda(torch.cuda.current_device())
    ddp, ddp_options = None, ddp_options or DDPOptions()
    if groups.dp_size == 1:  # nothing to reduce or gather: nothing to overlap
        ddp_options = dataclasses.replace(ddp_options, overlap_grad_reduce=False,
                                          overlap_param_gather=False)
    if role in FROZEN_ROLES:
        module.requires_grad_(False)
        module.eval()
    else:
        ddp = _wrap_ddp(module, config, pgc, ddp_options)
    return ShardedModel(role=role, module=module, spec=spec, groups=groups, pg_collection=pgc,
                        config=config, padded_vocab_size=vocab, dtype=dtype, uses_te=use_te,
                        ddp=ddp, ddp_options=ddp_options)


def zero_vocab_padding(module, vocab_size: int, padded: int, groups) -> None:
    """Rows of the padded vocab past ``vocab_size`` start at 0: no token reaches them, so they
    never train and checkpoints do not keep them; a resumed run (at any layout) then holds
    exactly the weights of the uninterrupted one (issue 32)."""
    rows = padded // groups.tp_size
    keep = max(0, min(rows, vocab_size - groups.tp_rank * rows))
    layers = (getattr(getattr(module, "embedding", None), "word_embeddings", None),
              getattr(module, "output_layer", None))
    with torch.no_grad():
        for layer in layers:
            weight = getattr(layer, "weight", None)
            if weight is not None and weight.dim() == 2 and weight.shape[0] == rows:
                weight[keep:].zero_()


def _wrap_ddp(module, config, pgc, options: DDPOptions):
    """megatron DDP: fp32 gradient buffers (``param.main_grad``), DP-averaged; with the
    distributed optimizer the buffers are reduce-scattered and parameters all-gathered."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=options.overlap_grad_reduce,
        overlap_param_gather=options.overlap_param_gather,
        use_distributed_optimizer=options.use_distributed_optimizer,
        bucket_size=options.bucket_size)
    ddp = DistributedDataParallel(config, ddp_config, module, pg_collection=pgc)
    if options.overlap_grad_reduce:  # the schedules start/finish the bucketed reduction
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    if options.overlap_param_gather:
        config.param_sync_func = ddp.start_param_sync
    return ddp


def build_actor(spec: LlamaSpec, groups, **kwargs) -> ShardedModel:
    return build_model(spec, groups, "actor", **kwargs)


def build_critic(spec: LlamaSpec, groups, **kwargs) -> ShardedModel:
    return build_model(spec, groups, "critic", **kwargs)


def build_reference(spec: LlamaSpec, groups, **kwargs) -> ShardedModel:
    return build_model(spec, groups, "reference", **kwargs)
