"""The builtin rollout engine: pure-torch llama inference on one gen TP rank's engine-format shard.

Contract:
- ``BuiltinEngine(spec, tp_group=None, tp_rank=0, tp_size=1, tp_src=None, device, dtype, pp_size,
  blocks=1, compact_at=0.25)``
  holds gen TP rank ``tp_rank`` of ``tp_size`` of a llama decoder described by ``EngineSpec``
  (RMSNorm, RoPE as HF llama / megatron non-interleaved, SwiGLU, GQA; q/k/v biases when
  ``qkv_bias``, as Qwen2 has them, and no other biases; per-head q/k RMSNorm before RoPE when
  ``qk_norm``, as Qwen3 has them; RoPE scaling ``rope_scaling`` (llama3, yarn) with inverse
  frequencies and the attention factor of ``hybridrl.models.rope``, the factor multiplying cos
  and sin as transformers does). Weights arrive
  by ``update_weights`` in the engine format (``hybridrl.reshard.formats.engine_format``):
  ``model.layers.L.self_attn.qkv_proj.weight`` [(hq + 2 hk)·hd, H] = [q; k; v] of the rank's
  hq = heads/tp query and hk = kv_heads/tp KV heads (``qkv_proj.bias`` [(hq + 2 hk)·hd] likewise),
  ``o_proj`` [H, hq·hd],
  ``mlp.gate_up_proj.weight`` [2F/tp, H] = [gate; up], ``down_proj`` [H, F/tp], norms [H]
  (``self_attn.q_norm.weight`` / ``k_norm.weight`` [hd], replicated, with ``qk_norm``), and
  vocab-parallel ``model.embed_tokens.weight`` / ``lm_head.weight`` [vocab_chunk, H] holding ids
  [tp_rank·chunk, (tp_rank+1)·chunk) (rows past the vocabulary are padding). A tied model may
  omit ``lm_head`` (the embedding is used).
- Storage (``hybridrl.rollout.builtin.weights``) is megatron's gen-layout layout, so the reshard
  can write into it in place: every tensor is stored exactly as megatron-core stores that
  rank's shard, which for all but qkv is the engine format itself; ``qkv_proj`` is stored
  grouped per KV head, [q heads of the group; k; v] (megatron's ``linear_qkv``), and
  ``update_weights`` regroups an engine-format [q; k; v] on load. ``blocks`` = K keeps every
  TP-sharded tensor as K sub-shards, each stored as megatron stores it at TP size tp·K (set K
  to train tp / gen tp: each sub-shard is then one training rank's tensor, received whole or
  aliased); the forward runs the K parts as K matmuls (column-parallel outputs concatenated,
  row-parallel partial products summed, the MLP per part). ``buffer(name, shape, block)``
  returns the part that holds ``name`` (allocated, zeroed, on first use) for a reshard to fill
  in place; ``alias(name, tensor, block)`` makes the engine read it from someone else's tensor
  (a training parameter of the same shard: no copy, no memory); a later
  ``update_weights``/``buffer`` gives it its own storage again. ``aliased`` labels the aliased
  parts; ``weights`` gives every loaded tensor's whole stored-layout shard.
- Row-parallel outputs (o_proj, down_proj) and the vocab-parallel embedding are summed with one
  all-reduce over ``tp_group``; last-position logits are all-gathered (real ids only) for
  sampling; ``tp_src`` (global rank of the group's first member) broadcasts the chosen tokens so
  every TP rank continues with the same ones.
- ``generate`` (see ``hybridrl.rollout.base``): prompts are left-padded in a KV cache of
  [B, hk, P + max_new, hd] per layer; positions count real tokens only; a row stops after its
  eos or any of ``params.stop_token_ids`` (the stop token is kept in the response); generation stops when every row stopped or after ``max_new_tokens``. Finished rows are
  not decoded further: once at least ``compact_at`` (default 0.25; 0 = never) of the rows
  being decoded have stopped, they leave the batch (KV cache rows, positions, per-row
  generators), so a long-tailed length mix costs what its live rows cost. A row's tokens
  and log-probs do not depend on it (up to matmul rounding at another batch size).
- Qwen3-MoE (``EngineSpec.num_experts`` > 0): every layer's MLP is a router and E experts
  (``hybridrl.rollout.builtin.moe``: softmax over E in fp32, top-k, renormalized when
  ``moe_norm_topk_prob``; each expert's F split over gen TP, the partial sums all-reduced like
  the dense MLP's). ``generate`` then also returns ``routed_experts`` (``rollout.base``).
- Gen pipeline parallelism is not supported: ``pp_size != 1`` raises ``ValueError``.
- Per decode step the work is the matmuls plus a fixed, small number of ops per layer: RoPE
  tables and the attention mask are built once per forward and shared by every layer, q and k
  are rotated together, attention is one fused ``scaled_dot_product_attention`` call (GQA
  without repeating K/V: SDPA's ``enable_gqa`` on CPU, a KV head's query heads stacked against
  it elsewhere, ``native_gqa``),
  and ``generate`` runs under ``inference_mode`` (it returns ordinary tensors).
  benchmarks/rollout_engine.py measures it against transformers' ``generate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.config.hf_model import RopeScaling
from hybridrl.models.rope import inv_freq
from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists
from hybridrl.rollout.builtin.moe import RoutingRecord, experts_forward, route
from hybridrl.rollout.builtin.weights import EngineWeights
from hybridrl.rollout.sampling import sample_next


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Sizes of the llama decoder the engine runs (full model, before TP)."""

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int  # real vocabulary (ids >= vocab_size are never sampled)
    vocab_chunk: int  # rows of embed/lm_head per TP rank (the engine's padded vocab / tp)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_seq_len: int = 2048
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    rope_scaling: RopeScaling | None = None  # llama3 / yarn (hybridrl.models.rope)
    max_position_embeddings: int | None = None  # the config's (yarn's default context)
    num_experts: int = 0  # Qwen3-MoE: experts per layer (0 = dense MLP)
    moe_topk: int = 0  # experts each token uses
    moe_ffn_hidden_size: int | None = None  # each expert's F (HF moe_intermediate_size)
    moe_norm_topk_prob: bool = True  # renormalize the top-k probabilities to sum 1

    def __post_init__(self) -> None:
        if self.num_experts:
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"moe_topk must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.moe_topk!r}")
            if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size < 1:
                raise ValueError(f"moe_ffn_hidden_size must be a positive integer with experts, "
                                 f"got {self.moe_ffn_hidden_size!r}")
            if self.num_experts >= 1 << 15:  # the routing record is int16
                raise ValueError(f"num_experts={self.num_experts} must be below 32768")

    @classmethod
    def from_llama(cls, spec, vocab_chunk: int, max_seq_len: int | None = None) -> EngineSpec:
        """From ``hybridrl.models.spec.LlamaSpec``; ``vocab_chunk`` from the gen placement."""
        return cls(spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads,
                   spec.num_query_groups, spec.head_dim, spec.num_layers, spec.vocab_size,
                   vocab_chunk, spec.rope_theta, spec.norm_eps, spec.tie_word_embeddings,
                   max_seq_len or spec.max_position_embeddings,
                   bool(getattr(spec, "qkv_bias", False)), bool(getattr(spec, "qk_norm", False)),
                   getattr(spec, "rope_scaling", None), spec.max_position_embeddings,
                   int(getattr(spec, "num_experts", 0) or 0), int(getattr(spec, "moe_topk", 0) or 0),
                   getattr(spec, "moe_ffn_hidden_size", None),
                   bool(getattr(spec, "moe_norm_topk_prob", True)))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), computed in fp32 and cast back first (HF llama)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)  # the same product, one op
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class BuiltinEngine:
    """One gen TP rank of a llama decoder with a KV cache (see module docstring)."""

    def __init__(self, spec: EngineSpec, *, tp_group: dist.ProcessGroup | None = None,
                 tp_rank: int = 0, tp_size: int = 1,
                 tp_src: int | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, pp_size: int = 1, blocks: int = 1,
                 compact_at: float = 0.25):
        if pp_size != 1:
            raise ValueError(f"the builtin engine needs gen pp = 1 (parallel.gen.pp), got {pp_size}")
        if spec.vocab_chunk * tp_size < spec.vocab_size:
            raise ValueError(f"vocab_chunk={spec.vocab_chunk} x tp={tp_size} does not cover "
                             f"vocab_size={spec.vocab_size}")
        if tp_size > 1 and tp_group is None:
            raise ValueError(f"tp_size={tp_size} needs tp_group")
        self.store = EngineWeights(spec, tp_size, blocks, dtype, device)  # checks divisibility
        self.spec, self.tp_group, self.tp_rank, self.tp_size = spec, tp_group, tp_rank, tp_size
        self.tp_src, self.blocks, self.compact_at = tp_src, blocks, compact_at
        self.device, self.dtype = torch.device(device), dtype
        self.hq = spec.num_attention_heads // tp_size  # local query heads
        self.hk = spec.num_kv_heads // tp_size  # local KV heads
        self.native_gqa = self.device.type == "cpu"  # attention form, see ``_mask``
        hd = spec.head_dim
        self.rope_factor = 1.0  # multiplies cos and sin (yarn's attention factor)
        if spec.rope_scaling is None:
            freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        else:  # transformers' fp32 frequencies, then the same float64 tables as above
            freq, self.rope_factor = inv_freq(hd, spec.rope_theta, spec.rope_scaling,
                                              spec.max_position_embeddings or spec.max_seq_len)
        # [hd/2] fp64, computed on the CPU, kept on the engine's device (no copy per forward)
        self.inv_freq = freq.double().to(self.device)

    # ----------------------------------------------------------------------------- weights
    @property
    def aliased(self) -> set[str]:
        return self.store.aliased

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Every loaded tensor's whole stored-layout shard (new tensors where kept in parts)."""
        return {n: self.store.full(n) for n in self.store.parts if self.store.loaded(n)}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (a subset of) this rank's engine-format tensors; see the module docstring."""
        self.store.update(named_tensors)

    def block_shape(self, name: str) -> tuple[int, ...]:
        return self.store.block_shape(name)

    def buffer(self, name: str, shape, block: int | None = None) -> torch.Tensor:
        """The engine's own tensor for ``name`` (part ``block``), to be filled in place."""
        return self.store.buffer(name, shape, block)

    def alias(self, name: str, tensor: torch.Tensor, block: int | None = None) -> None:
        """Read ``name`` (part ``block``) from ``tensor`` itself (stored layout, no copy)."""
        self.store.alias(name, tensor, block)

    def arrange(self, order, spare=()) -> None:
        """Lay the listed (name, block) parts out in one buffer (``EngineWeights.arrange``)."""
        self.store.arrange(order, spare)

    def spare(self, view: torch.Tensor) -> int:
        return self.store.spare(view)

    def tensor_addresses(self) -> tuple:
        """(label, address, shape) of every weight tensor held now (replay validity)."""
        return tuple((n, k, p.data_ptr(), tuple(p.shape)) for n, parts in self.store.parts.items()
                     for k, p in enumerate(parts) if p is not None)

    def finish_update(self) -> None:
        """End of a weight sync: nothing to do, ``update_weights`` already loaded (no collective)."""

    def missing_weights(self) -> list[str]:
        return self.store.missing()

    def _parts(self, name: str) -> list[torch.Tensor]:
        return self.store.parts[name]

    def _w(self, name: str) -> torch.Tensor:  # a tensor kept as one part (norms; blocks = 1)
        return self.store.parts[name][0]

    def _col(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W.T of a column-parallel W kept in parts (outputs concatenated)."""
        parts = self._parts(name)
        if len(parts) == 1:
            return x @ parts[0].T
        return torch.cat([x @ w.T for w in parts], dim=-1)

    def _row(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W.T of a row-parallel W kept in parts (column blocks: partial products summed)."""
        parts = self._parts(name)
        c = parts[0].shape[1]
        out = x[..., :c] @ parts[0].T
        for k, w in enumerate(parts[1:], start=1):
            out += x[..., k * c:(k + 1) * c] @ w.T
        return out

    # ----------------------------------------------------------------------------- forward
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, ids_BS: torch.Tensor) -> torch.Tensor:
        parts = self._parts("model.embed_tokens.weight")
        if self.tp_size == 1 and len(parts) == 1:
            return F.embedding(ids_BS, parts[0])
        h_BSH, c = None, parts[0].shape[0]  # each part holds c consecutive vocabulary rows
        for k, w in enumerate(parts):
            local_BS = ids_BS - (self.tp_rank * self.spec.vocab_chunk + k * c)
            mine_BS = (local_BS >= 0) & (local_BS < c)
            e_BSH = F.embedding(local_BS.clamp(0, c - 1), w) * mine_BS.unsqueeze(-1).to(w.dtype)
            h_BSH = e_BSH if h_BSH is None else h_BSH + e_BSH
        return self._all_reduce(h_BSH)

    def _rope_tables(self, pos_BS: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, 1, S, D] of the positions, once per forward (shared by every layer)."""
        freqs_BSd = pos_BS.double().unsqueeze(-1) * self.inv_freq  # positions on self.device
        emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1).unsqueeze(1)  # [B, 1, S, D]
        if self.rope_factor != 1.0:
            return ((emb_BSD.cos() * self.rope_factor).to(dtype),
                    (emb_BSD.sin() * self.rope_factor).to(dtype))
        return emb_BSD.cos().to(dtype), emb_BSD.sin().to(dtype)

    @staticmethod
    def _rope(x_BNSD: torch.Tensor, rope) -> torch.Tensor:
        cos, sin = rope
        return x_BNSD * cos + _rotate_half(x_BNSD) * sin

    def _attention(self, L: int, h_BSH, rope, cache, start: int, allowed_BSK):
        hd = self.spec.head_dim
        p = f"model.layers.{L}."
        B, S, _ = h_BSH.shape
        rep = self.hq // self.hk
        qkv = self._col(h_BSH, p + "self_attn.qkv_proj.weight")
        if self.spec.qkv_bias:
            bias = self._parts(p + "self_attn.qkv_proj.bias")
            qkv = qkv + (bias[0] if len(bias) == 1 else torch.cat(bias))
        g = qkv.view(B, S, self.hk, rep + 2, hd).permute(0, 2, 3, 1, 4)  # [B, hk, rep+2, S, hd]
        qk = g[:, :, :rep + 1]
        if self.spec.qk_norm:  # per-head RMSNorm of the queries and the key, before RoPE
            eps = self.spec.norm_eps
            qk = torch.cat([_rms_norm(qk[:, :, :rep], self._w(p + "self_attn.q_norm.weight"), eps),
                            _rms_norm(qk[:, :, rep:], self._w(p + "self_attn.k_norm.weight"), eps)],
                           dim=2)
        qk = self._rope(qk.reshape(B, self.hk * (rep + 1), S, hd), rope)
        qk = qk.view(B, self.hk, rep + 1, S, hd)  # each KV head's query heads, then its key
        q, k_BNSD = qk[:, :, :rep], qk[:, :, rep]
        keys, values = cache[L]
        keys[:, :, start:start + S] = k_BNSD
        values[:, :, start:start + S] = g[:, :, rep + 1]
        K = start + S
        # one fused attention call, GQA without repeating K/V (see ``_mask``): query head n
        # reads KV head n // rep
        if self.native_gqa:
            out_BNSD = F.scaled_dot_product_attention(
                q.reshape(B, self.hq, S, hd), keys[:, :, :K], values[:, :, :K],
                attn_mask=allowed_BSK, enable_gqa=rep > 1)
        else:  # a KV head's rep query heads stacked as rep*S rows against its keys
            out_BNSD = F.scaled_dot_product_attention(
                q.reshape(B, self.hk, rep * S, hd), keys[:, :, :K], values[:, :, :K],
                attn_mask=allowed_BSK).view(B, self.hq, S, hd)
        out_BSX = out_BNSD.transpose(1, 2).reshape(B, S, self.hq * hd)
        return self._all_reduce(self._row(out_BSX, p + "self_attn.o_proj.weight"))

    def _mlp(self, L: int, h_BSH: torch.Tensor, routed=None) -> torch.Tensor:
        p = f"model.layers.{L}."
        if self.spec.num_experts:
            return self._moe(L, h_BSH, routed)
        out = None
        for gate_up, down in zip(self._parts(p + "mlp.gate_up_proj.weight"),
                                 self._parts(p + "mlp.down_proj.weight")):
            gate, up = (h_BSH @ gate_up.T).chunk(2, dim=-1)  # each part: [gate_k; up_k]
            y = (F.silu(gate) * up) @ down.T
            out = y if out is None else out.add_(y)
        return self._all_reduce(out)

    def _moe(self, L: int, h_BSH: torch.Tensor, routed) -> torch.Tensor:
        """Qwen3-MoE feed-forward (``hybridrl.rollout.builtin.moe``); ``routed`` = (record,
        rows, start) stores the layer's top-k ids."""
        p, (B, S, H) = f"model.layers.{L}.mlp.", h_BSH.shape
        x_TH = h_BSH.reshape(B * S, H)
        w_Tk, ids_Tk = route(x_TH, self._w(p + "gate.weight"), self.spec.moe_topk,
                             self.spec.moe_norm_topk_prob)
        if routed is not None:
            record, rows, start = routed
            record.put(rows, start, L, ids_Tk.view(B, S, -1))

        def parts(e: int):
            return list(zip(self._parts(f"{p}experts.{e}.gate_up_proj.weight"),
                            self._parts(f"{p}experts.{e}.down_proj.weight")))

        return self._all_reduce(experts_forward(x_TH, ids_Tk, w_Tk, parts).view(B, S, H))

    def _mask(self, allowed_BSK: torch.Tensor) -> torch.Tensor:
        """The bool attention mask of every layer (True = attend; the diagonal always is, so no
        row is fully masked): [B, 1, S, K] for SDPA's own GQA (``enable_gqa``: torch's CPU
        kernel runs it fused), or, rows repeated for the rep query heads of a KV head, [B, 1,
        rep*S, K] for the stacked form (CUDA: with a mask, ``enable_gqa`` only has the math
        kernel, which repeats K/V; the stacked form runs in the memory-efficient one)."""
        B, S, K = allowed_BSK.shape
        if self.native_gqa:
            return allowed_BSK.unsqueeze(1)
        rep = self.hq // self.hk
        return allowed_BSK[:, None, None].expand(B, 1, rep, S, K).reshape(B, 1, rep * S, K)

    def forward(self, ids_BS, pos_BS, cache, start: int, allowed_BSK, record=None,
                rows=None) -> torch.Tensor:
        """Hidden states [B, S, H] after the final norm; fills ``cache`` columns [start, start+S)
        (and, for a MoE model, ``record``'s columns of the batch rows ``rows``)."""
        routed = None if record is None else (record, rows, start)
        eps = self.spec.norm_eps
        h = self._embed(ids_BS)
        rope = self._rope_tables(pos_BS, h.dtype)
        allowed_BSK = self._mask(allowed_BSK)
        for L in range(self.spec.num_layers):
            p = f"model.layers.{L}."
            h = h + self._attention(L, _rms_norm(h, self._w(p + "input_layernorm.weight"), eps),
                                    rope, cache, start, allowed_BSK)
            h = h + self._mlp(L, _rms_norm(h, self._w(p + "post_attention_layernorm.weight"), eps),
                              routed)
        return _rms_norm(h, self._w("model.norm.weight"), eps)

    def logits(self, h_BH: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V] (real ids only) from final hidden states [B, H]."""
        head = "lm_head.weight" if self.store.loaded("lm_head.weight") else "model.embed_tokens.weight"
        local_BC = self._col(h_BH, head).float()
        if self.tp_size > 1:
            parts = [torch.empty_like(local_BC) for _ in range(self.tp_size)]
            dist.all_gather(parts, local_BC.contiguous(), group=self.tp_group)
            local_BC = torch.cat(parts, dim=-1)
        return local_BC[:, : self.spec.vocab_size]

    # ----------------------------------------------------------------------------- generate
    def _new_cache(self, B: int, T: int):
        shape = (B, self.hk, T, self.spec.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.spec.num_layers)]

    def _sync_tokens(self, tokens_B: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            src = self.tp_src if self.tp_src is not None else dist.get_process_group_ranks(
                self.tp_group)[0]
            dist.broadcast(tokens_B, src=src, group=self.tp_group)
        return tokens_B

    def generate(self, prompt_ids, params: SamplingParams) -> GenerationOutput:
        """Sample responses for ``prompt_ids`` (see ``hybridrl.rollout.base``)."""
        with torch.inference_mode():  # less per-op bookkeeping than no_grad
            ids, mask, logp, routed = self._generate(prompt_ids, params)
        return GenerationOutput(ids.clone(), mask.clone(), logp.clone(),  # ordinary tensors
                                None if routed is None else routed.clone())

    def _generate(self, prompt_ids, params: SamplingParams):
        missing = self.missing_weights()
        if missing:
            raise ValueError(f"builtin engine: weights not loaded yet: {missing[:4]} "
                             f"({len(missing)} missing); call update_weights first")
        prompts = as_prompt_lists(prompt_ids)
        B, P, R = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
        if P + R > self.spec.max_seq_len:
            raise ValueError(f"prompt length {P} + max_new_tokens {R} exceeds the engine's "
                             f"max_seq_len={self.spec.max_seq_len}")
        if any(t < 0 or t >= self.spec.vocab_size for p in prompts for t in p):
            raise ValueError(f"prompt_ids hold ids outside [0, {self.spec.vocab_size})")
        dev = self.device
        ids_BP = torch.full((B, P), params.pad_token_id, dtype=torch.long, device=dev)
        valid_BT = torch.zeros(B, P + R, dtype=torch.bool, device=dev)  # real key columns
        for b, p in enumerate(prompts):
            ids_BP[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            valid_BT[b, P - len(p):P] = True
        pos_BP = (valid_BT[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        cols = torch.arange(P + R, device=dev)
        causal_PK = cols[:P, None] >= cols[None, :P]
        allowed = causal_PK & (valid_BT[:, None, :P] | torch.eye(P, dtype=torch.bool, device=dev))
        cache = self._new_cache(B, P + R)
        record = (RoutingRecord(B, P + R, self.spec.num_layers, self.spec.moe_topk, dev)
                  if self.spec.num_experts else None)
        live = torch.arange(B, device=dev)  # the batch's rows still decoded (see compact_at)
        h = self.forward(ids_BP, pos_BP, cache, 0, allowed, record, live)[:, -1]
        if params.row_seeds is not None:  # one generator per request
            if len(params.row_seeds) != B:
                raise ValueError(f"row_seeds has {len(params.row_seeds)} seeds for {B} prompts")
            generator = [torch.Generator(device=dev).manual_seed(int(s)) for s in params.row_seeds]
        else:
            generator = torch.Generator(device=dev).manual_seed(int(params.seed))
        out_ids = torch.full((B, R), params.pad_token_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros(B, R, dtype=torch.float32, device=dev)
        done_b = torch.zeros(B, dtype=torch.bool, device=dev)
        next_pos_b = pos_BP[:, -1] + 1
        steps = 0
        stops = torch.tensor(params.stop_ids, device=h.device) if params.stop_ids else None
        for j in range(R):
            tokens_b, logp_b = sample_next(self.logits(h), params, generator)
            tokens_b = self._sync_tokens(tokens_b.masked_fill(done_b, params.pad_token_id))
            out_ids[live, j] = tokens_b
            out_logp[live, j] = logp_b.masked_fill(done_b, 0.0)
            valid_BT[live, P + j] = ~done_b
            steps = j + 1
            if stops is not None:  # eos and the stop ids end a row (the token is kept)
                done_b = done_b | torch.isin(tokens_b, stops)
            if bool(done_b.all()) or j == R - 1:
                break
            if int(done_b.sum()) >= self.compact_at * len(live) > 0:  # drop the finished rows
                keep = torch.nonzero(~done_b).flatten()  # the same on every TP rank (synced)
                cache = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in cache]
                live, tokens_b, next_pos_b = live[keep], tokens_b[keep], next_pos_b[keep]
                done_b = done_b[keep]
                if isinstance(generator, list):
                    generator = [generator[i] for i in keep.tolist()]
            c = P + j
            allowed = (valid_BT[live, : c + 1] | (cols[: c + 1] == c)).unsqueeze(1)  # [b, 1, K]
            h = self.forward(tokens_b[:, None], next_pos_b[:, None], cache, c, allowed, record,
                             live)[:, -1]
            next_pos_b = next_pos_b + 1
        mask = valid_BT[:, P:P + steps].long()
        routed = None if record is None else record.aligned(
            [len(p) for p in prompts], mask.sum(-1).tolist(), P)[:, :P + steps]
        return (out_ids[:, :steps] * mask + params.pad_token_id * (1 - mask), mask,
                out_logp[:, :steps] * mask, routed)
