"""hybridrl's local (non-TE) layer spec: megatron's modules with lean forwards for the plain case.

Contract:
- ``local_layer_spec()`` is megatron-core's ``get_gpt_layer_local_spec(normalization="RMSNorm")``
  with four modules swapped for subclasses defined here. Parameters, their names, shapes,
  initialization and TP sharding are megatron's (checkpoints, the reshard and HF IO see no
  difference); only the forward of the common case is shorter:
  * ``SDPACoreAttention`` replaces ``DotProductAttention``: softmax(q k^T * scale + mask) v in one
    ``torch.nn.functional.scaled_dot_product_attention`` call on this TP rank's heads (GQA without
    repeating keys/values; fp32 softmax accumulation). Scale: ``softmax_scale`` or 1/sqrt(hn)
    (megatron's query-key layer scaling divides and multiplies by the layer number: the same net
    scale). Mask: megatron's convention (True = masked out); None with a causal mask type means
    causal (sq == sk); a given mask is used alone, as megatron does. Attention dropout (0 in
    hybridrl's configs) runs inside megatron's model-parallel RNG fork, as megatron's does.
    Context parallelism, sliding windows and non-vanilla softmax raise ``ValueError`` at
    construction; attention biases at forward (megatron's module neither). Packed sequences
    (``packed_seq_params``, THD, cp 1, no padded cu_seqlens; q/k/v [t, 1, heads, hn] from the lean
    attention or [t, heads, hn] from megatron's own): each sequence attends over itself alone
    (``hybridrl.models.packing.varlen_attention``; megatron's DotProductAttention refuses THD).
    A shared-prompt pack (its ``PackedSeqParams`` carry the segments' parents, set by
    ``hybridrl.models.forward``) takes ``packing.shared_attention`` instead: each response
    segment also reads its prompt segment's keys and values.
  * ``LeanColumnParallelLinear`` / ``LeanRowParallelLinear``: ``F.linear`` (native autograd) over
    the tokens as one 2-D GEMM instead of megatron's Python autograd functions, with megatron's
    TP mappings around it (column: backward all-reduce of the input gradient, optional output
    gather; row: forward all-reduce, then the bias). Same products, same reductions.
  * ``LeanSelfAttention``: QKV projection, Qwen3's per-head q/k RMSNorm when the spec has it
    (megatron's ``q_layernorm`` / ``k_layernorm`` modules, applied to the query and key heads),
    RoPE applied once to the query and key heads together (cos/sin cached per rotary tensor,
    which megatron's RotaryEmbedding itself caches per length), core attention, output
    projection: megatron's arithmetic, fewer Python calls. A shared-prompt pack's RoPE reads
    the pack's explicit positions; it runs this forward under sequence parallelism too (the
    linears then gather and scatter the sequence as megatron's own), and a layer that needs
    megatron's forward (``lean_shared`` False) refuses such a pack with one ValueError line.
  * ``LeanTransformerLayer``: norm -> attention -> residual add -> norm -> MLP -> residual add,
    with megatron's bias/dropout/residual semantics (dropout skipped when its probability is 0).
  * From ``hybridrl.models.local_fused``: ``SequenceParallelNorm`` (the layers' two norms and,
    via hybridrl.models.cpu_compat, the block's final norm) and ``QKNorm`` (Qwen3's q/k norms),
    megatron's torch norms allowed under sequence parallelism, built as
    ``hybridrl.kernels.norm.FusedRMSNorm`` (the fused CPU RMSNorm, same parameters and state
    dict); ``LeanMLP``, which ``LeanTransformerLayer`` makes of its dense MLP (fc1 -> fused
    SwiGLU -> fc2). RoPE runs ``hybridrl.kernels.swiglu.apply_rope`` (one fused pass each way on
    CPU, bit for bit the eager formula in fp32).
  ``make_output_layer_lean(gpt_model)`` gives the output layer (built by GPTModel, not by the
  spec) the lean linear forward. Each lean forward runs only when nothing needs megatron's own
  (no sequence parallelism, recompute, offloading, fp8/fp4, CUDA graphs, gradient-accumulation
  fusion, inference context, packed sequences other than plain THD (the lean attention takes
  those: RoPE angles at each token's position inside its own sequence, ``packing.positions``),
  cross attention, MoE, partial or interleaved RoPE, q/k norms other than torch's RMSNorm,
  output gates); otherwise the module calls megatron's forward unchanged.
- Numerics: tests/unit/test_models_local_spec.py checks each module against megatron's original
  (outputs and gradients, fp32 and bf16, GQA, masks, TP head slices); tests/distributed/
  test_models.py checks whole models against transformers.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from hybridrl.kernels.swiglu import apply_rope
from hybridrl.models.local_fused import QKNorm, SequenceParallelNorm, make_mlp_lean
from hybridrl.models.packing import (
    attention_path,
    batch_index,
    block_causal_mask,
    host_cu_seqlens,
    pack_cached,
    positions,
    shared_attention,
    shared_state,
    varlen_attention,
)


def _needs_megatron(config, sp: bool = True) -> bool:
    """True when a config option changes what megatron's own forwards do beyond the plain case
    (``sp=False``: sequence parallelism not counted)."""
    return bool(
        (sp and config.sequence_parallel) or config.recompute_granularity is not None
        or config.fp8 or getattr(config, "fp4", None) or config.cpu_offloading
        or getattr(config, "fine_grained_activation_offloading", False)
        or config.cuda_graph_impl != "none" or config.gradient_accumulation_fusion
        or config.defer_embedding_wgrad_compute or config.inference_fuse_tp_communication
        or config.tp_comm_overlap)


class SDPACoreAttention(MegatronModule):
    """megatron ``DotProductAttention`` semantics on ``F.scaled_dot_product_attention``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        for name, bad in (("context_parallel_size", config.context_parallel_size != 1),
                          ("window_size", config.window_size is not None),
                          ("softmax_type", config.softmax_type != "vanilla")):
            if bad:
                raise ValueError(f"SDPACoreAttention does not support {name}="
                                 f"{getattr(config, name)!r}; use megatron's DotProductAttention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn]."""
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention supports no attention bias (megatron's "
                             "DotProductAttention neither)")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b, heads, hn = query.shape
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        causal = mask is None and mask_type == AttnMaskType.causal and sq > 1
        if causal and sq != key.shape[0]:
            raise ValueError(f"causal attention needs sq == sk, got sq={sq}, sk={key.shape[0]}")
        q_BNSD = query.permute(1, 2, 0, 3)
        k_BGSD, v_BGSD = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        kwargs = dict(attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
                      enable_gqa=heads != k_BGSD.shape[1])
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD,
                                                          dropout_p=dropout, **kwargs)
        else:
            out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, **kwargs)
        return out_BNSD.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)  # [sq, b, np*hn]

    def _packed(self, query, key, value, params):
        """THD: q [t, (1,) np, hn], k/v [t, (1,) ng, hn] -> [t, 1, np*hn], each sequence alone."""
        if params.qkv_format != "thd" or params.cu_seqlens_q_padded is not None:
            raise ValueError("SDPACoreAttention takes packed sequences as qkv_format='thd' "
                             f"without padded cu_seqlens, got {params.qkv_format!r}")
        if query.dim() == 3:  # megatron's own SelfAttention squeezes the batch dimension
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        t, _, heads, hn = query.shape
        cu = host_cu_seqlens(params)  # host bounds: no device read per layer
        parents = pack_cached(params, "parents", lambda: None)  # a shared-prompt pack's
        if parents is not None:
            path, mask, plan = shared_state(params, cu, parents, query.device)
            attend = functools.partial(shared_attention, parents=parents, path=path, mask=mask,
                                       plan=plan)
        else:
            path = pack_cached(params, "attention_path", lambda: attention_path(cu))
            mask = index = None  # built once per pack, shared by the layers
            if path == "mask":
                mask = pack_cached(params, ("mask", query.device),
                                   lambda: block_causal_mask(cu, query.device))
            elif path == "batch":
                index = pack_cached(params, ("batch_index", query.device),
                                    lambda: batch_index(cu, query.device))
            attend = functools.partial(varlen_attention, mask=mask, path=path, index=index)
        q_BNSD = query.permute(1, 2, 0, 3)
        k_BGSD, v_BGSD = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        dropout = self.dropout_p if self.training else 0.0
        rng = (tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0.0
               else contextlib.nullcontext())
        with rng:
            out_BNSD = attend(q_BNSD, k_BGSD, v_BGSD, cu, scale=self.softmax_scale,
                              dropout_p=dropout)
        return out_BNSD.permute(2, 0, 1, 3).reshape(t, 1, heads * hn)  # [t, 1, np*hn]


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` over the tokens as one 2-D GEMM. On an [s, 1, h] input whose size-1 dim has
    an odd stride (a transposed [1, s, h]: megatron's embedding hands the first layer one)
    ``F.linear`` takes a much slower CPU path (measured 4-5x at [175, 384] x [384, 640])."""
    out = F.linear(x.reshape(-1, x.shape[-1]), weight)
    return out.view(*x.shape[:-1], out.shape[-1])


class LeanColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear; the plain forward is ``F.linear`` + TP mappings."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_lean()

    def _set_lean(self) -> None:
        self.lean = not (_needs_megatron(self.config) or self.is_expert
                         or self.disable_grad_reduce)
        self.tp_size = self.tp_group.size()

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.lean or self.config._cpu_offloading_context is not None:
            return super().forward(input_, weight, runtime_gather_output)
        weight = self.weight if weight is None else weight
        if self.tp_size > 1:  # identity; the backward all-reduces the input gradient
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output = _linear(input_, weight)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias  # as megatron: matmul, then the bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.tp_size > 1:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class LeanRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear; the plain forward is ``F.linear`` + the TP all-reduce."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean = not (_needs_megatron(self.config) or self.explicit_expert_comm
                         or not self.input_is_parallel)
        self.tp_size = self.tp_group.size()

    def forward(self, input_):
        if not self.lean or self.config._cpu_offloading_context is not None:
            return super().forward(input_)
        output = _linear(input_, self.weight)
        if self.tp_size > 1:
            output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def _lean_packing(params) -> bool:
    """True when the lean forward can take ``packed_seq_params``: none, or plain THD."""
    return params is None or (params.qkv_format == "thd" and params.cu_seqlens_q_padded is None
                              and params.cu_seqlens_kv_padded is None
                              and params.cu_seqlens_kv is params.cu_seqlens_q
                              and (params.cp_group is None or params.cp_group.size() == 1))


def _shared(params) -> bool:
    """True for a shared-prompt pack (its segments' parents set by the forward)."""
    return params is not None and pack_cached(params, "parents", lambda: None) is not None


class LeanSelfAttention(SelfAttention):
    """megatron's SelfAttention; the plain forward rotates q and k heads in one pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        # Qwen3's per-head q/k RMSNorm (megatron's local spec: torch RMSNorm over hn)
        self.qk_norm = all(isinstance(m, torch.nn.RMSNorm)
                           for m in (self.q_layernorm, self.k_layernorm))
        self.lean_shared = not (  # sequence parallelism: the linears gather and scatter
            _needs_megatron(cfg, sp=False) or cfg.attention_output_gate or cfg.no_rope_freq
            or cfg.rotary_interleaved or cfg.apply_rope_fusion or cfg.fused_single_qkv_rope
            or cfg.multi_latent_attention or getattr(cfg, "mrope_section", None)
            or hasattr(cfg, "yarn_rotary_scaling_factor") or self.checkpoint_core_attention
            or self.offload_qkv_linear or self.offload_core_attention or self.offload_attn_proj
            or not isinstance(self.core_attention, SDPACoreAttention)
            or not (self.qk_norm or all(m is None or isinstance(m, IdentityOp)
                                        for m in (self.q_layernorm, self.k_layernorm)))
            or self.num_query_groups_per_partition * self.world_size != cfg.num_query_groups)
        self.lean = self.lean_shared and not cfg.sequence_parallel
        self._rope = None  # (rotary tensor, dtype, cos, sin)

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype, packed=None):
        """cos/sin of megatron's rotary tensor [s, 1, 1, hn] as [s, 1, 1, 1, hn] in ``dtype``;
        for a pack, row t holds the angle of token t's position inside its own sequence."""
        if packed is not None:  # once per pack and dtype, shared by the layers
            def build():
                pos = pack_cached(packed, "positions",
                                  lambda: positions(host_cu_seqlens(packed)))
                f = freqs[pos.to(freqs.device, non_blocking=True)].unsqueeze(3)
                return f.cos().to(dtype), f.sin().to(dtype)
            return pack_cached(packed, ("rope", dtype, freqs.data_ptr(), freqs.shape[0]), build)
        cached = self._rope
        if cached is None or cached[0] is not freqs or cached[1] != dtype:
            f = freqs.unsqueeze(3)
            cached = self._rope = (freqs, dtype, f.cos().to(dtype), f.sin().to(dtype))
        return cached[2], cached[3]

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        hn = self.hidden_size_per_attention_head
        shared = _shared(packed_seq_params)
        if shared and not self.lean_shared:
            raise ValueError("a shared-prompt pack needs the local spec's lean attention (RoPE "
                             "at its explicit positions); use forward.shares_prompts first")
        megatron_only = (
            not (self.lean or shared) or key_value_states is not None
            or inference_context is not None or inference_params is not None
            or rotary_pos_cos is not None or rotary_pos_sin is not None
            or rotary_pos_cos_sin is not None or attention_bias is not None
            or not _lean_packing(packed_seq_params) or sequence_len_offset is not None
            or isinstance(rotary_pos_emb, tuple)
            or (rotary_pos_emb is not None and rotary_pos_emb.shape[-1] != hn)
            or self.config._cpu_offloading_context is not None)
        if megatron_only and shared:  # megatron's THD RoPE would restart at every segment
            raise ValueError("a shared-prompt pack reached an attention call only megatron's "
                             "forward runs (RoPE tables given, an attention bias, offloading or a "
                             "KV offset); set model.share_prompts=false for this model")
        if megatron_only:
            return super().forward(
                hidden_states, attention_mask, key_value_states, inference_context,
                rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                attention_bias, packed_seq_params, sequence_len_offset,
                inference_params=inference_params)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups  # query heads per group
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, ng * (per_group + 2) * hn]
        s, b = mixed.shape[:2]
        mixed_SBGKD = mixed.view(s, b, groups, per_group + 2, hn)  # per group: q.., k, v
        qk_SBGKD = mixed_SBGKD[:, :, :, :per_group + 1]
        if self.qk_norm:  # each query and key head normalized over hn, before RoPE
            qk_SBGKD = torch.cat([self.q_layernorm(qk_SBGKD[:, :, :, :per_group]),
                                  self.k_layernorm(qk_SBGKD[:, :, :, per_group:])], dim=3)
        if rotary_pos_emb is not None:
            cos, sin = self._cos_sin(rotary_pos_emb, qk_SBGKD.dtype, packed_seq_params)
            qk_SBGKD = apply_rope(qk_SBGKD, cos, sin)  # one fused pass on CPU
        query = qk_SBGKD[:, :, :, :per_group].reshape(s, b, groups * per_group, hn)
        key, value = qk_SBGKD[:, :, :, per_group], mixed_SBGKD[:, :, :, per_group + 1]
        context = self.core_attention(query, key, value, attention_mask,
                                      attn_mask_type=self.attn_mask_type,
                                      packed_seq_params=packed_seq_params)
        return self.linear_proj(context)


class LeanTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer; the plain forward is the pre-norm residual block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        make_mlp_lean(self.mlp)  # the dense MLP's forward: fc1 -> fused SwiGLU -> fc2
        self.lean = not (
            _needs_megatron(self.config) or self.is_moe_layer or self.recompute_input_layernorm
            or self.recompute_pre_mlp_layernorm or self.recompute_mlp or self.offload_attn_norm
            or self.offload_mlp_norm or not isinstance(self.cross_attention, IdentityOp)
            or not isinstance(self.pre_cross_attn_layernorm, IdentityOp))

    def _residual(self, out_with_bias, residual):
        """megatron's bias-dropout-add: (x + bias) -> dropout -> residual + x."""
        x, bias = out_with_bias
        residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
        if bias is not None:
            x = x + bias
        if self.training and self.hidden_dropout > 0.0:
            x = F.dropout(x, p=self.hidden_dropout, training=True)
        return residual + x

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, **kwargs):
        kwargs.pop("dynamic_inference_decode_only", None)
        packed = kwargs.pop("packed_seq_params", None)
        if packed is not None:
            kwargs["packed_seq_params"] = packed  # megatron's forward gets it back
        if (not self.lean or not _lean_packing(packed) or context is not None or context_mask is not None
                or any(v is not None for k, v in kwargs.items() if k != "packed_seq_params")
                or hasattr(self, "cudagraph_manager")):
            return super().forward(hidden_states, attention_mask, context, context_mask,
                                   rotary_pos_emb, **kwargs)
        attention = self.self_attention(self.input_layernorm(hidden_states),
                                        attention_mask=attention_mask,
                                        rotary_pos_emb=rotary_pos_emb,
                                        packed_seq_params=packed)
        hidden_states = self._residual(attention, hidden_states)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden_states))
        output = self._residual(mlp, hidden_states)
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad,
                                    keep_graph=True), context


def make_output_layer_lean(gpt_model) -> bool:
    """Give a GPTModel's output layer (megatron's ColumnParallelLinear, which GPTModel builds
    itself, outside the layer spec) the lean forward: its class becomes
    ``LeanColumnParallelLinear``, a subclass that adds no parameter, buffer or hook, so weights,
    tying and checkpoints are untouched. True when it did (not for a value head)."""
    layer = getattr(gpt_model, "output_layer", None)
    if type(layer) is not ColumnParallelLinear:
        return False
    layer.__class__ = LeanColumnParallelLinear
    layer._set_lean()
    return True


def local_layer_spec(qk_layernorm: bool = False, num_experts: int = 0):
    """megatron's local GPT layer spec (RMSNorm; ``qk_layernorm``: per-head q/k RMSNorm, as
    Qwen3 has) with this module's lean subclasses; ``num_experts`` > 0: megatron's MoELayer
    (SequentialMLP experts of megatron's own linears) as the MLP, run by megatron's forward."""
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts or None, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=qk_layernorm)
    spec.module = LeanTransformerLayer
    spec.submodules.input_layernorm = SequenceParallelNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    attention = spec.submodules.self_attention
    attention.module = LeanSelfAttention
    attention.submodules.core_attention = SDPACoreAttention
    attention.submodules.linear_qkv = LeanColumnParallelLinear
    attention.submodules.linear_proj = LeanRowParallelLinear
    if qk_layernorm:
        attention.submodules.q_layernorm = attention.submodules.k_layernorm = QKNorm
    if not num_experts:
        mlp = spec.submodules.mlp.submodules
        mlp.linear_fc1, mlp.linear_fc2 = LeanColumnParallelLinear, LeanRowParallelLinear
    return spec
