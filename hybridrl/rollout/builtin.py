"""The builtin rollout engine: pure-torch llama inference on one gen TP rank's engine-format shard.

Contract:
- ``BuiltinEngine(spec, tp_group=None, tp_rank=0, tp_size=1, tp_src=None, device, dtype, pp_size)``
  holds gen TP rank ``tp_rank`` of ``tp_size`` of a llama decoder described by ``EngineSpec``
  (RMSNorm, RoPE as HF llama / megatron non-interleaved, SwiGLU, GQA; q/k/v biases when
  ``qkv_bias``, as Qwen2 has them, and no other biases). Weights arrive
  by ``update_weights`` in the engine format (``hybridrl.reshard.formats.engine_format``):
  ``model.layers.L.self_attn.qkv_proj.weight`` [(hq + 2 hk)·hd, H] = [q; k; v] of the rank's
  hq = heads/tp query and hk = kv_heads/tp KV heads (``qkv_proj.bias`` [(hq + 2 hk)·hd] likewise),
  ``o_proj`` [H, hq·hd],
  ``mlp.gate_up_proj.weight`` [2F/tp, H] = [gate; up], ``down_proj`` [H, F/tp], norms [H], and
  vocab-parallel ``model.embed_tokens.weight`` / ``lm_head.weight`` [vocab_chunk, H] holding ids
  [tp_rank·chunk, (tp_rank+1)·chunk) (rows past the vocabulary are padding). A tied model may
  omit ``lm_head`` (the embedding is used).
- Storage is megatron's gen-layout layout, so the reshard can write into it in place: every
  tensor is stored exactly as megatron-core stores that rank's shard, which for all but qkv is
  the engine format itself; ``qkv_proj`` is stored grouped per KV head, [q heads of the group;
  k; v] (megatron's ``linear_qkv``), and ``update_weights`` regroups an engine-format [q; k; v]
  on load. ``buffer(name, shape)`` returns the tensor that holds ``name`` (allocated, zeroed, on
  first use) for a reshard to fill in place; ``alias(name, tensor)`` makes the engine read
  ``name`` from someone else's tensor (a training parameter of the same shard: no copy, no
  memory); a later ``update_weights``/``buffer`` of that name gives it its own storage again.
  ``aliased`` names the aliased tensors.
- Row-parallel outputs (o_proj, down_proj) and the vocab-parallel embedding are summed with one
  all-reduce over ``tp_group``; last-position logits are all-gathered (real ids only) for
  sampling; ``tp_src`` (global rank of the group's first member) broadcasts the chosen tokens so
  every TP rank continues with the same ones.
- ``generate`` (see ``hybridrl.rollout.base``): prompts are left-padded in a KV cache of
  [B, hk, P + max_new, hd] per layer; positions count real tokens only; a row stops after its
  eos; generation stops when every row stopped or after ``max_new_tokens``.
- Gen pipeline parallelism is not supported: ``pp_size != 1`` raises ``ValueError``.
- Per decode step the work is the matmuls plus a fixed, small number of ops per layer: RoPE
  tables and the additive attention mask are built once per forward and shared by every layer,
  q and k are rotated together, GQA stacks a KV head's query heads instead of repeating K/V,
  and ``generate`` runs under ``inference_mode`` (it returns ordinary tensors).
  benchmarks/rollout_engine.py measures it against transformers' ``generate``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists
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

    @classmethod
    def from_llama(cls, spec, vocab_chunk: int, max_seq_len: int | None = None) -> EngineSpec:
        """From ``hybridrl.models.spec.LlamaSpec``; ``vocab_chunk`` from the gen placement."""
        return cls(spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads,
                   spec.num_query_groups, spec.head_dim, spec.num_layers, spec.vocab_size,
                   vocab_chunk, spec.rope_theta, spec.norm_eps, spec.tie_word_embeddings,
                   max_seq_len or spec.max_position_embeddings,
                   bool(getattr(spec, "qkv_bias", False)))


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

    def __init__(self, spec: EngineSpec, *, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
                 tp_src: int | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, pp_size: int = 1):
        if pp_size != 1:
            raise ValueError(f"the builtin engine needs gen pp = 1 (parallel.gen.pp), got {pp_size}")
        for field, value in (("num_attention_heads", spec.num_attention_heads),
                             ("num_kv_heads", spec.num_kv_heads),
                             ("ffn_hidden_size", spec.ffn_hidden_size)):
            if value % tp_size:
                raise ValueError(f"gen tp={tp_size} does not divide {field}={value}")
        if spec.vocab_chunk * tp_size < spec.vocab_size:
            raise ValueError(f"vocab_chunk={spec.vocab_chunk} x tp={tp_size} does not cover "
                             f"vocab_size={spec.vocab_size}")
        if tp_size > 1 and tp_group is None:
            raise ValueError(f"tp_size={tp_size} needs tp_group")
        self.spec, self.tp_group, self.tp_rank, self.tp_size = spec, tp_group, tp_rank, tp_size
        self.tp_src = tp_src
        self.device, self.dtype = torch.device(device), dtype
        self.hq = spec.num_attention_heads // tp_size  # local query heads
        self.hk = spec.num_kv_heads // tp_size  # local KV heads
        self.weights: dict[str, torch.Tensor] = {}
        self.aliased: set[str] = set()
        self.expected = self._expected_shapes()
        hd = spec.head_dim
        self.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))

    # ----------------------------------------------------------------------------- weights
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        s, hd = self.spec, self.spec.head_dim
        H, f = s.hidden_size, s.ffn_hidden_size // self.tp_size
        out = {"model.embed_tokens.weight": (s.vocab_chunk, H), "model.norm.weight": (H,),
               "lm_head.weight": (s.vocab_chunk, H)}
        for L in range(s.num_layers):
            p = f"model.layers.{L}."
            out.update({p + "input_layernorm.weight": (H,),
                        p + "post_attention_layernorm.weight": (H,),
                        p + "self_attn.qkv_proj.weight": ((self.hq + 2 * self.hk) * hd, H),
                        p + "self_attn.o_proj.weight": (H, self.hq * hd),
                        p + "mlp.gate_up_proj.weight": (2 * f, H),
                        p + "mlp.down_proj.weight": (H, f)})
            if s.qkv_bias:
                out[p + "self_attn.qkv_proj.bias"] = ((self.hq + 2 * self.hk) * hd,)
        return out

    def _check(self, name: str, shape) -> tuple[int, ...]:
        want = self.expected.get(name)
        if want is None:
            raise ValueError(f"builtin engine: unknown weight {name!r}")
        if tuple(shape) != want:
            raise ValueError(f"builtin engine: {name} has shape {tuple(shape)}, "
                             f"expected {want} (gen tp={self.tp_size})")
        return want

    def _grouped(self, qkv: torch.Tensor) -> torch.Tensor:
        """Engine-format [q; k; v] rows -> the stored layout [per KV head: its q heads; k; v]."""
        hd, rest = self.spec.head_dim, tuple(qkv.shape[1:])
        q, k, v = qkv.split([self.hq * hd, self.hk * hd, self.hk * hd])
        return torch.cat([q.reshape(self.hk, -1, *rest), k.reshape(self.hk, hd, *rest),
                          v.reshape(self.hk, hd, *rest)], dim=1).reshape(qkv.shape)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (a subset of) this rank's engine-format tensors; see the module docstring."""
        for name, tensor in named_tensors:
            self._check(name, tensor.shape)
            if ".qkv_proj." in name:
                tensor = self._grouped(tensor)
            with torch.no_grad():
                self.buffer(name, tensor.shape).copy_(tensor)

    def buffer(self, name: str, shape) -> torch.Tensor:
        """The engine's own tensor for ``name`` (stored layout), to be filled in place."""
        want = self._check(name, shape)
        if name in self.aliased or name not in self.weights:
            self.aliased.discard(name)
            self.weights[name] = torch.zeros(want, dtype=self.dtype, device=self.device)
        return self.weights[name]

    def alias(self, name: str, tensor: torch.Tensor) -> None:
        """Read ``name`` from ``tensor`` itself (stored layout, the engine's dtype and device)."""
        self._check(name, tensor.shape)
        if tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(f"builtin engine: cannot alias {name} ({tensor.dtype}, "
                             f"{tensor.device}); the engine runs {self.dtype} on {self.device}")
        self.weights[name] = tensor.detach()
        self.aliased.add(name)

    def finish_update(self) -> None:
        """End of a weight sync: nothing to do, ``update_weights`` already loaded (no collective)."""

    def missing_weights(self) -> list[str]:
        optional = {"lm_head.weight"} if self.spec.tie_word_embeddings else set()
        return sorted(set(self.expected) - set(self.weights) - optional)

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    # ----------------------------------------------------------------------------- forward
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, ids_BS: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids_BS, self._w("model.embed_tokens.weight"))
        local_BS = ids_BS - self.tp_rank * self.spec.vocab_chunk
        mine_BS = (local_BS >= 0) & (local_BS < self.spec.vocab_chunk)
        h_BSH = F.embedding(local_BS.clamp(0, self.spec.vocab_chunk - 1),
                            self._w("model.embed_tokens.weight"))
        return self._all_reduce(h_BSH * mine_BS.unsqueeze(-1).to(h_BSH.dtype))

    def _rope_tables(self, pos_BS: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, 1, S, D] of the positions, once per forward (shared by every layer)."""
        freqs_BSd = pos_BS.double().unsqueeze(-1) * self.inv_freq.to(pos_BS.device)
        emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1).unsqueeze(1)  # [B, 1, S, D]
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
        qkv = h_BSH @ self._w(p + "self_attn.qkv_proj.weight").T
        if self.spec.qkv_bias:
            qkv = qkv + self._w(p + "self_attn.qkv_proj.bias")
        g = qkv.view(B, S, self.hk, rep + 2, hd).permute(0, 2, 3, 1, 4)  # [B, hk, rep+2, S, hd]
        qk = self._rope(g[:, :, :rep + 1].reshape(B, self.hk * (rep + 1), S, hd), rope)
        qk = qk.view(B, self.hk, rep + 1, S, hd)  # each KV head's query heads, then its key
        q_BGRD, k_BNSD = qk[:, :, :rep].reshape(B, self.hk, rep * S, hd), qk[:, :, rep]
        keys, values = cache[L]
        keys[:, :, start:start + S] = k_BNSD
        values[:, :, start:start + S] = g[:, :, rep + 1]
        K = start + S
        # GQA without repeating K/V: the rep = hq/hk query heads of a KV head are stacked as
        # rep*S rows against that head's keys; allowed_BSK is the additive fp32 mask [B, 1, rep*S, K]
        scores = (q_BGRD @ keys[:, :, :K].transpose(-1, -2)).float() / math.sqrt(hd)
        probs = torch.softmax(scores + allowed_BSK, dim=-1).to(values.dtype)  # [B, hk, rep*S, K]
        out_BNSD = (probs @ values[:, :, :K]).view(B, self.hq, S, hd)
        out_BSX = out_BNSD.transpose(1, 2).reshape(B, S, self.hq * hd)
        return self._all_reduce(out_BSX @ self._w(p + "self_attn.o_proj.weight").T)

    def _mlp(self, L: int, h_BSH: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{L}."
        gate, up = (h_BSH @ self._w(p + "mlp.gate_up_proj.weight").T).chunk(2, dim=-1)
        return self._all_reduce((F.silu(gate) * up) @ self._w(p + "mlp.down_proj.weight").T)

    def forward(self, ids_BS, pos_BS, cache, start: int, allowed_BSK) -> torch.Tensor:
        """Hidden states [B, S, H] after the final norm; fills ``cache`` columns [start, start+S)."""
        eps = self.spec.norm_eps
        h = self._embed(ids_BS)
        rope = self._rope_tables(pos_BS, h.dtype)
        # additive fp32 mask built once for every layer: 0 allowed, -inf not, [B, 1, rep*S, K]
        # (rows repeated for the rep query heads of a KV head; the diagonal is always allowed)
        B, S, K = allowed_BSK.shape
        rep = self.hq // self.hk
        allowed_BSK = torch.zeros((B, S, K), device=h.device).masked_fill_(
            ~allowed_BSK, float("-inf"))[:, None, None].expand(B, 1, rep, S, K).reshape(
            B, 1, rep * S, K)
        for L in range(self.spec.num_layers):
            p = f"model.layers.{L}."
            h = h + self._attention(L, _rms_norm(h, self._w(p + "input_layernorm.weight"), eps),
                                    rope, cache, start, allowed_BSK)
            h = h + self._mlp(L, _rms_norm(h, self._w(p + "post_attention_layernorm.weight"), eps))
        return _rms_norm(h, self._w("model.norm.weight"), eps)

    def logits(self, h_BH: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V] (real ids only) from final hidden states [B, H]."""
        head = self.weights.get("lm_head.weight", None)
        if head is None:
            head = self._w("model.embed_tokens.weight")
        local_BC = (h_BH @ head.T).float()
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
            ids, mask, logp = self._generate(prompt_ids, params)
        return GenerationOutput(ids.clone(), mask.clone(), logp.clone())  # ordinary tensors

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
        h = self.forward(ids_BP, pos_BP, cache, 0, allowed)[:, -1]
        if params.row_seeds is not None:  # one generator per request
            if len(params.row_seeds) != B:
                raise ValueError(f"row_seeds has {len(params.row_seeds)} seeds for {B} prompts")
            generator = [torch.Generator(device=dev).manual_seed(int(s)) for s in params.row_seeds]
        else:
            generator = torch.Generator(device=dev).manual_seed(int(params.seed))
        out_ids = torch.full((B, R), params.pad_token_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros(B, R, dtype=torch.float32, device=dev)
        done_B = torch.zeros(B, dtype=torch.bool, device=dev)
        next_pos_B = pos_BP[:, -1] + 1
        steps = 0
        for j in range(R):
            tokens_B, logp_B = sample_next(self.logits(h), params, generator)
            tokens_B = self._sync_tokens(tokens_B.masked_fill(done_B, params.pad_token_id))
            out_ids[:, j] = tokens_B
            out_logp[:, j] = logp_B.masked_fill(done_B, 0.0)
            valid_BT[:, P + j] = ~done_B
            steps = j + 1
            if params.eos_token_id is not None:
                done_B = done_B | (tokens_B == params.eos_token_id)
            if bool(done_B.all()) or j == R - 1:
                break
            c = P + j
            allowed = (valid_BT[:, : c + 1] | (cols[: c + 1] == c)).unsqueeze(1)  # [B, 1, K]
            h = self.forward(tokens_B[:, None], next_pos_B[:, None], cache, c, allowed)[:, -1]
            next_pos_B = next_pos_B + 1
        mask = valid_BT[:, P:P + steps].long()
        return (out_ids[:, :steps] * mask + params.pad_token_id * (1 - mask), mask,
                out_logp[:, :steps] * mask)
