"""Packed sequences: whole sequences concatenated into one row, attention over each alone.

Contract:
- A packed micro-batch is a dict with ``input_ids`` [1, S] (the sequences one after another,
  S = the sum of their lengths, no pad token) and ``cu_seqlens`` [n + 1] int32 (sequence i holds
  positions ``cu_seqlens[i]:cu_seqlens[i + 1]``; ``cu_seqlens[0] = 0``, ``cu_seqlens[-1] = S``).
  ``pack_sequences(seqs)`` builds both from 1-D token tensors (each at least one token).
- ``extend_tail(cu_seqlens, total)``: when a pack is right-padded to ``total`` tokens (sequence
  parallelism needs S a multiple of tp) the pad joins the LAST sequence: causal attention keeps
  its real tokens blind to it, so no real output changes, and ``cu_seqlens[-1]`` stays the row
  length as megatron's THD path expects.
- ``positions(cu_seqlens)`` [S]: each token's position inside its own sequence (0, 1, ... from
  every sequence start): RoPE restarts at 0 for each sequence, as in the padded layout.
- ``packed_seq_params(cu_seqlens, device)``: megatron's ``PackedSeqParams`` (qkv_format "thd",
  cu_seqlens for q and kv on ``device``, their max length), what GPTModel.forward takes; on the
  TE spec megatron hands it to TE's THD attention and fused RoPE (GPU), on hybridrl's local spec
  to ``varlen_attention`` and the lean RoPE (``hybridrl.models.local_spec``). Everything the
  host needs (the max length, the sequence bounds) is read from the host copy of
  ``cu_seqlens``: no device-to-host wait per micro-batch or per layer on a GPU.
  ``host_cu_seqlens(params)``: that host copy. ``pack_cached(params, key, build)``: a value
  computed once per pack and shared by every layer
  (the host ``cu_seqlens`` under ``"cu_host"``, the block mask, RoPE's cos/sin), kept on the
  ``PackedSeqParams`` object itself, so it lives exactly as long as the pack.
- ``varlen_attention(q, k, v, cu_seqlens, scale, dropout_p)``: causal attention of each
  sequence over itself alone; q [1, np, S, hn], k/v [1, ng, S, hn] (GQA when np > ng) ->
  [1, np, S, hn]. A pack of one sequence is one causal SDPA call; a pack of many short
  sequences (``use_mask``: S^2 <= ``MASK_COST_RATIO`` x n) one SDPA call with a block-diagonal
  causal mask (``block_causal_mask``, or the given ``mask``); otherwise one causal SDPA call per
  sequence (the mask costs S^2; measured in docs/models.md). All three are exact: a token's
  softmax runs over the keys of its own sequence only.
- ``token_counts(micro_batches, multiple)`` -> (real, computed): the real tokens of micro-batches
  (packed: ``cu_seqlens[-1]``; padded: ``seq_lens`` when given, else the non-pad count is
  unknown and every token is real) and the tokens the forward computes (``input_ids.numel()``
  with T rounded up to ``multiple``, the sequence-parallel pad).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# one masked SDPA call over the pack when S^2 <= MASK_COST_RATIO x (number of sequences): the
# [S, S] mask costs ~5e-5 ms x S^2, a call per sequence ~0.2 ms (fwd + bwd, one CPU thread,
# 4 heads x 16; docs/models.md)
MASK_COST_RATIO = 4000


def use_mask(cu_seqlens: torch.Tensor) -> bool:
    """True when one block-masked SDPA call beats one call per sequence (several sequences)."""
    n = len(cu_seqlens) - 1
    return n > 1 and int(cu_seqlens[-1]) ** 2 <= MASK_COST_RATIO * n


def pack_sequences(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [1, S], cu_seqlens [n + 1] int32) of 1-D token tensors, in order."""
    if not seqs or any(s.numel() < 1 for s in seqs):
        raise ValueError("a pack needs at least one sequence, each of at least one token; got "
                         f"lengths {[int(s.numel()) for s in seqs]}")
    lens = torch.tensor([0] + [int(s.numel()) for s in seqs], dtype=torch.int64)
    return torch.cat(seqs).long().unsqueeze(0), lens.cumsum(0).to(torch.int32)


def extend_tail(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``cu_seqlens`` whose last sequence also holds the pad up to ``total`` tokens."""
    end = int(cu_seqlens[-1])
    if total < end:
        raise ValueError(f"a pack of {end} tokens cannot shrink to {total}")
    if total == end:
        return cu_seqlens
    out = cu_seqlens.clone()
    out[-1] = total
    return out


def positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S] position of each token inside its own sequence."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lens)
    return torch.arange(int(cu[-1]), device=cu.device) - starts


def packed_seq_params(cu_seqlens: torch.Tensor, device=None):
    """megatron's ``PackedSeqParams`` of one pack (THD), cu_seqlens on ``device``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    host = cu_seqlens.to("cpu", torch.int32)
    longest = int((host[1:] - host[:-1]).max())
    cu = host if device is None else host.to(device, non_blocking=True)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    pack_cached(params, "cu_host", lambda: host)
    return params


def host_cu_seqlens(params) -> torch.Tensor:
    """The pack's cu_seqlens on the host (set by ``packed_seq_params``; else copied once)."""
    return pack_cached(params, "cu_host", lambda: params.cu_seqlens_q.cpu())


def pack_cached(params, key, build):
    """``build()`` once per pack (``params``: its ``PackedSeqParams``), shared by every layer."""
    cache = params.__dict__.setdefault("_hybridrl_pack_cache", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def block_causal_mask(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor:
    """[S, S] bool, True = attend: same sequence and key position <= query position."""
    cu = cu_seqlens.long().cpu()  # built on the host (S <= ~4000 here), then moved once
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    idx = torch.arange(int(cu[-1]))
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return mask.to(device) if device is not None else mask


def varlen_attention(q_BNSD, k_BGSD, v_BGSD, cu_seqlens, scale: float,
                     dropout_p: float = 0.0, mask=None) -> torch.Tensor:
    """Causal attention of each packed sequence over itself (see the module docstring)."""
    gqa = q_BNSD.shape[1] != k_BGSD.shape[1]
    kwargs = dict(scale=scale, enable_gqa=gqa, dropout_p=dropout_p)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    total = bounds[-1]
    if len(bounds) == 2:  # one sequence: plain causal attention
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=total > 1,
                                              **kwargs)
    if mask is not None or use_mask(cu_seqlens):
        if mask is None:
            mask = block_causal_mask(cu_seqlens, q_BNSD.device)
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, attn_mask=mask, **kwargs)
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(
            q_BNSD[:, :, lo:hi], k_BGSD[:, :, lo:hi], v_BGSD[:, :, lo:hi],
            is_causal=hi - lo > 1, **kwargs))
    return torch.cat(outs, dim=2)


def token_counts(micro_batches, multiple: int = 1) -> tuple[int, int]:
    """(real tokens, computed tokens) of ``micro_batches`` (see the module docstring)."""
    real = computed = 0
    for mb in micro_batches:
        b, t = mb["input_ids"].shape
        computed += b * (t + (-t % multiple))
        if "cu_seqlens" in mb:
            real += int(mb["cu_seqlens"][-1])
        elif "seq_lens" in mb:
            real += int(mb["seq_lens"].sum())
        else:
            real += b * t
    return real, computed
