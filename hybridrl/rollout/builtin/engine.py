"""The builtin rollout engine: pure-torch llama inference on one gen TP rank's engine-format shard.

Contract:
- ``BuiltinEngine(spec, tp_group=None, tp_rank=0, tp_size=1, tp_src=None, device, dtype, pp_size,
  blocks=1, compact_at=0.25, share_prefill=True)``
  holds gen TP rank ``tp_rank`` of ``tp_size`` of a llama decoder described by ``EngineSpec``
  (``hybridrl.rollout.builtin.spec``)
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
- ``generate`` (see ``hybridrl.rollout.base``; the loop: ``hybridrl.rollout.builtin.decode``):
  prompts are left-padded in a KV cache of [B, hk, P + max_new, hd] per layer; positions count
  real tokens only; a row stops after its eos or any of ``params.stop_token_ids`` (the stop
  token is kept in the response); generation stops when every row stopped or after
  ``max_new_tokens``. Rows with identical prompts are prefilled once and their K/V copied
  (``share_prefill``, default on: a GRPO batch of n samples per prompt prefills each prompt
  once). Finished rows are not decoded further: once at least ``compact_at`` (default 0.25;
  0 = never) of the rows being decoded have stopped, they leave the batch (KV cache rows,
  positions, per-row generators), so a long-tailed length mix costs what its live rows cost.
  A row's tokens and log-probs depend on neither (up to matmul rounding at another batch size).
- ``open_session()`` (``hybridrl.rollout.builtin.session``): calls that keep each sequence's
  K/V after it stops on a stop id and continue it in a later call, prefilling only the tokens
  appended since (an agent loop's tool output and template tokens).
- Qwen3-MoE (``EngineSpec.num_experts`` > 0): every layer's MLP is a router and E experts
  (``hybridrl.rollout.builtin.moe``: softmax over E in fp32, top-k, renormalized when
  ``moe_norm_topk_prob``; each expert's F split over gen TP, the partial sums all-reduced like
  the dense MLP's). ``generate`` then also returns ``routed_experts`` (``rollout.base``).
- Gen pipeline parallelism is not supported: ``pp_size != 1`` raises ``ValueError``.
- Per decode step the work is the matmuls plus a fixed, small number of ops per layer: RoPE
  tables and the attention mask are built once per forward and shared by every layer, q and k
  are rotated together, attention is one fused ``scaled_dot_product_attention`` call (GQA
  without repeating K/V: SDPA's ``enable_gqa`` on CPU, a KV head's query heads stacked against
  it elsewhere, ``native_gqa``); on CPU the fp32 norms, the SwiGLU and a decode step's RoPE are
  hybridrl's fused kernels (``hybridrl.kernels.norm`` / ``swiglu``: one pass each, the eager
  formula where they do not apply), and ``generate`` runs under ``inference_mode`` (it returns
  ordinary tensors).
  benchmarks/rollout_engine.py measures it against transformers' ``generate``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.kernels.norm import rms_norm
from hybridrl.kernels.swiglu import apply_rope, swiglu
from hybridrl.models.rope import inv_freq
from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists
from hybridrl.rollout.builtin.decode import generate_rows
from hybridrl.rollout.builtin.moe import experts_forward, route
from hybridrl.rollout.builtin.session import KVSession
from hybridrl.rollout.builtin.spec import EngineSpec
from hybridrl.rollout.builtin.weights import EngineWeights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), computed in fp32 and cast back first (HF llama)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return rms_norm(x, weight, eps)  # the same product, one fused op on CPU
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class BuiltinEngine:
    """One gen TP rank of a llama decoder with a KV cache (see module docstring)."""

    def __init__(self, spec: EngineSpec, *, tp_group: dist.ProcessGroup | None = None,
                 tp_rank: int = 0, tp_size: int = 1,
                 tp_src: int | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, pp_size: int = 1, blocks: int = 1,
                 compact_at: float = 0.25, share_prefill: bool = True):
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
        self.share_prefill = share_prefill
        self.prefilled = 0  # real prompt tokens prefilled so far (``decode``)

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
        cos, sin = rope  # [B, 1, S, D]: the fused CPU op when S == 1 (decode), else eager
        return apply_rope(x_BNSD, cos, sin)

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
            y = swiglu(h_BSH @ gate_up.T) @ down.T  # each part: [gate_k; up_k]
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
        return self._run(as_prompt_lists(prompt_ids), params)[0]

    def open_session(self) -> KVSession:
        """Calls that continue their sequences' kept caches (``hybridrl.rollout.builtin.session``)."""
        return KVSession(self)

    def _run(self, prompts: list[list[int]], params: SamplingParams, resume=None,
             keep: bool = False) -> tuple[GenerationOutput, dict]:
        missing = self.missing_weights()
        if missing:
            raise ValueError(f"builtin engine: weights not loaded yet: {missing[:4]} "
                             f"({len(missing)} missing); call update_weights first")
        with torch.inference_mode():  # less per-op bookkeeping than no_grad
            ids, mask, logp, routed, kept = generate_rows(self, prompts, params, resume, keep)
        # ordinary tensors out; the kept K/V stay inference tensors (read only in here)
        out = GenerationOutput(ids.clone(), mask.clone(), logp.clone(),
                               None if routed is None else routed.clone())
        return out, kept
