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
  [1, np, S, hn]. ``attention_path(cu_seqlens)`` picks the cheapest of four exact ways:
  ``one`` (a pack of one sequence: one causal SDPA call), ``batch`` (the sequences laid out
  as a right-padded batch [n, np, L_max, hn], one causal SDPA call, the real positions read
  back: a pure view when every length is equal, so a pack of uniform lengths costs what the
  padded layout costs), ``mask`` (one SDPA call with a block-diagonal causal [S, S] mask,
  ``block_causal_mask``) and ``loop`` (one causal SDPA call per sequence). The cost model
  counts attention score elements (batch n * L_max^2, mask S^2, loop sum L_i^2) plus
  ``CALL_COST_ELEMENTS`` per SDPA call (batch counts two: its copies), from fwd + bwd timings
  at one CPU thread (docs/models.md: a call's overhead is worth ~12,000 score elements at
  head dims 16-64). All four are exact: a real token's softmax runs over the keys of its own
  sequence only (right padding is invisible to causal attention). ``use_mask(cu_seqlens)``:
  the path is ``mask``. ``batch_index(cu_seqlens)``: the batch path's gather index, which a
  caller may compute once per pack and pass in (``index=``) with the path (``path=``).
- Shared prompts (``RolloutBatch.microbatch(share=True)``): a pack may also carry
  ``parents`` [n] (segment i continues segment ``parents[i]``, or -1) and explicit
  ``position_ids``. A segment with a parent attends to ALL of its parent, then causally to
  itself; a root segment (-1) is causal over itself alone. A group's prompt is computed once
  and each of its responses reads the prompt's keys/values: exact (a prompt position never sees
  a response), and the prompt's gradients are the sum over its responses.
  ``shared_path(cu_seqlens, parents)`` picks ``mask`` (one SDPA call, ``shared_block_mask``
  [S, S]) or ``grouped`` (the roots by ``varlen_attention``; per group one SDPA call: its
  responses as a right-padded batch [k, np, R_max, hn] over cat(prompt K/V expanded to k rows,
  own K/V), bottom-right causal) by the same cost model; ``shared_attention`` runs it,
  ``shared_plan`` is the grouped path's host/device index state; ``shared_state(params, ...)``
  builds (path, mask, plan) once per pack (``pack_cached``).
- ``token_counts(micro_batches, multiple)`` -> (real, computed): the real tokens of micro-batches
  (packed: ``cu_seqlens[-1]``; padded: ``seq_lens`` when given, else the non-pad count is
  unknown and every token is real) and the tokens the forward computes (``input_ids.numel()``
  with T rounded up to ``multiple``, the sequence-parallel pad).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# what one SDPA call costs beyond its attention scores, in score elements: fwd + bwd at one CPU
# thread, 4 q / 2 kv heads of 16, 32 and 64 dims, the overhead of a call per sequence (slicing,
# the gradient's scatter back) is 0.14-0.43 ms and a score element 1.2e-5 to 3e-5 ms: ~12,000
# elements at every head dim measured (docs/models.md, benchmarks/packing.py --attention)
CALL_COST_ELEMENTS = 12000
PATHS = ("one", "batch", "mask", "loop")


def attention_path(cu_seqlens: torch.Tensor) -> str:
    """The cheapest exact attention path of a pack (see the module docstring)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n = len(lens)
    if n == 1:
        return "one"
    if min(lens) == max(lens):
        return "batch"  # a view: the padded layout's single call, no copy, no pad
    call = CALL_COST_ELEMENTS
    costs = {"batch": 2 * call + n * max(lens) ** 2, "mask": call + cu[-1] ** 2,
             "loop": n * call + sum(x * x for x in lens)}
    return min(costs, key=costs.__getitem__)


def use_mask(cu_seqlens: torch.Tensor) -> bool:
    """True when the pack's cheapest path is one block-masked SDPA call."""
    return attention_path(cu_seqlens) == "mask"


def batch_index(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor | None:
    """[S] row-major slot of each packed token in the [n, L_max] batch layout; None when every
    length is equal (the layout is then a pure view of the pack)."""
    cu = cu_seqlens.long().cpu()
    lens = cu[1:] - cu[:-1]
    width = int(lens.max())
    if int(lens.min()) == width:
        return None
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    index = seg * width + positions(cu)
    return index.to(device) if device is not None else index


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
                     dropout_p: float = 0.0, mask=None, path: str | None = None,
                     index=None) -> torch.Tensor:
    """Causal attention of each packed sequence over itself (see the module docstring).

    ``mask`` (the block mask) implies the mask path; ``path`` forces one of ``PATHS``;
    ``index``: ``batch_index(cu_seqlens)`` computed once by the caller."""
    gqa = q_BNSD.shape[1] != k_BGSD.shape[1]
    kwargs = dict(scale=scale, enable_gqa=gqa, dropout_p=dropout_p)
    if path is None:
        path = "mask" if mask is not None else attention_path(cu_seqlens)
    if path not in PATHS:
        raise ValueError(f"attention path must be one of {PATHS}, got {path!r}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if path == "one" and len(bounds) > 2:
        raise ValueError(f"attention path 'one' needs a pack of one sequence, got "
                         f"{len(bounds) - 1}")
    if len(bounds) == 2:  # one sequence: plain causal attention
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD,
                                              is_causal=bounds[-1] > 1, **kwargs)
    if path == "batch":
        return _batched(q_BNSD, k_BGSD, v_BGSD, bounds, kwargs, index)
    if path == "mask":
        if mask is None:
            mask = block_causal_mask(cu_seqlens, q_BNSD.device)
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, attn_mask=mask, **kwargs)
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(
            q_BNSD[:, :, lo:hi], k_BGSD[:, :, lo:hi], v_BGSD[:, :, lo:hi],
            is_causal=hi - lo > 1, **kwargs))
    return torch.cat(outs, dim=2)


def _batched(q_BNSD, k_BGSD, v_BGSD, bounds, kwargs, index) -> torch.Tensor:
    """The pack as a right-padded batch [n, heads, L_max, hn]: one causal SDPA call (exact for
    the real positions: causal attention never looks right, at the pad)."""
    n = len(bounds) - 1
    width = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    uniform = width * n == bounds[-1]
    if not uniform and index is None:
        index = batch_index(torch.tensor(bounds), q_BNSD.device)

    def to_batch(x_1HSD):
        x_HSD = x_1HSD[0]
        if not uniform:
            slots = x_HSD.new_zeros(x_HSD.shape[0], n * width, x_HSD.shape[2])
            x_HSD = slots.index_copy(1, index, x_HSD)
        return x_HSD.reshape(x_HSD.shape[0], n, width, x_HSD.shape[2]).transpose(0, 1)

    out_BNLD = F.scaled_dot_product_attention(to_batch(q_BNSD), to_batch(k_BGSD),
                                              to_batch(v_BGSD), is_causal=width > 1, **kwargs)
    out_NSD = out_BNLD.transpose(0, 1).reshape(out_BNLD.shape[1], n * width,
                                               out_BNLD.shape[3])
    if not uniform:
        out_NSD = out_NSD.index_select(1, index)
    return out_NSD.unsqueeze(0)


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


def _path_cost(lens: list[int]) -> int:
    """The cheapest plain varlen path's cost of segments of these lengths (score elements)."""
    if len(lens) == 1:
        return CALL_COST_ELEMENTS + lens[0] ** 2
    call, n = CALL_COST_ELEMENTS, len(lens)
    return min(2 * call + n * max(lens) ** 2, call + sum(lens) ** 2,
               n * call + sum(x * x for x in lens))


def _shared_groups(parents: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """(root segments, {parent segment: its child segments, in order})."""
    roots, kids = [], {}
    for i, p in enumerate(parents):
        if p < 0:
            roots.append(i)
        else:
            kids.setdefault(p, []).append(i)
    return roots, kids


def shared_path(cu_seqlens: torch.Tensor, parents: list[int]) -> str:
    """``mask`` or ``grouped``: the cheaper exact way to attend a shared-prompt pack."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    roots, kids = _shared_groups(parents)
    grouped = _path_cost([lens[i] for i in roots]) if roots else 0
    for p, ch in kids.items():
        width = max(lens[c] for c in ch)
        grouped += 3 * CALL_COST_ELEMENTS + len(ch) * width * (lens[p] + width)
    return "mask" if CALL_COST_ELEMENTS + cu[-1] ** 2 <= grouped else "grouped"


def shared_block_mask(cu_seqlens: torch.Tensor, parents: list[int], device=None):
    """[S, S] bool, True = attend: same segment and key <= query, or the key in the query
    segment's parent."""
    cu = cu_seqlens.long().cpu()
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    par = torch.tensor(parents, dtype=torch.long)[seg]  # [S] parent segment of each token
    idx = torch.arange(int(cu[-1]))
    mask = ((seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])) \
        | (par[:, None] == seg[None, :])
    return mask.to(device) if device is not None else mask


def shared_plan(cu_seqlens: torch.Tensor, parents: list[int], device=None) -> dict:
    """The grouped path's indices: root tokens and their cu_seqlens, per group its prompt span,
    its responses' span, batch index and mask, and the inverse order of the pieces."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    roots, kids = _shared_groups(parents)
    root_idx = [t for i in roots for t in range(cu[i], cu[i + 1])]
    order, groups = list(root_idx), []
    for p, ch in kids.items():
        lo, hi = cu[ch[0]], cu[ch[-1] + 1]
        if [cu[c + 1] for c in ch[:-1]] != [cu[c] for c in ch[1:]]:
            raise ValueError(f"shared prompt {p}: its response segments {ch} must be adjacent")
        sub = torch.tensor([cu[c] - lo for c in ch] + [hi - lo])
        width, plen = int((sub[1:] - sub[:-1]).max()), cu[p + 1] - cu[p]
        cols = torch.arange(plen + width)
        mask = cols[None, :] <= torch.arange(width)[:, None] + plen  # bottom-right causal
        index = batch_index(sub)
        groups.append(dict(prompt=(cu[p], cu[p + 1]), span=(lo, hi), n=len(ch), width=width,
                           mask=mask.to(device), index=None if index is None else index.to(device)))
        order.extend(range(lo, hi))
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    root_cu = torch.tensor([0] + [cu[i + 1] - cu[i] for i in roots]).cumsum(0)
    root_path = attention_path(root_cu) if roots else None
    return dict(root_idx=torch.tensor(root_idx, dtype=torch.long, device=device),
                root_cu=root_cu, root_path=root_path,
                root_mask=block_causal_mask(root_cu, device) if root_path == "mask" else None,
                root_index=batch_index(root_cu, device) if root_path == "batch" else None,
                groups=groups, inverse=inverse.to(device))


def group_mask(group: dict, device: torch.device):
    """A group's bottom-right causal mask [width, P + width]: the plan's bool tensor on CPU; on
    CUDA torch's ``causal_lower_right`` bias (the same mask, never materialized), which SDPA
    runs in its flash kernel with GQA (fp16 / bf16): a bool mask with GQA leaves it only the
    math kernel, whose scores every layer keeps for the backward (tens of GB per layer at a
    1k-token prompt with 16 responses of 4k)."""
    if device.type != "cuda":
        return group["mask"]
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(group["width"], group["mask"].shape[1])


def shared_state(params, cu_seqlens, parents: list[int], device):
    """(path, mask, plan) of a shared-prompt pack, built once per pack on its
    ``PackedSeqParams`` (``pack_cached``) and shared by the layers."""
    path = pack_cached(params, "attention_path", lambda: shared_path(cu_seqlens, parents))
    if path == "mask":
        return path, pack_cached(params, ("mask", device),
                                 lambda: shared_block_mask(cu_seqlens, parents, device)), None
    return path, None, pack_cached(params, ("plan", device),
                                   lambda: shared_plan(cu_seqlens, parents, device))


def shared_attention(q_BNSD, k_BGSD, v_BGSD, cu_seqlens, parents: list[int], scale: float,
                     dropout_p: float = 0.0, path: str | None = None, mask=None,
                     plan: dict | None = None) -> torch.Tensor:
    """Attention of a shared-prompt pack (see the module docstring); [1, np, S, hn]."""
    gqa = q_BNSD.shape[1] != k_BGSD.shape[1]
    kwargs = dict(scale=scale, enable_gqa=gqa, dropout_p=dropout_p)
    path = path or shared_path(cu_seqlens, parents)
    if path == "mask":
        if mask is None:
            mask = shared_block_mask(cu_seqlens, parents, q_BNSD.device)
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, attn_mask=mask, **kwargs)
    if path != "grouped":
        raise ValueError(f"shared attention path must be 'mask' or 'grouped', got {path!r}")
    plan = plan or shared_plan(cu_seqlens, parents, q_BNSD.device)
    pieces = []
    if plan["root_idx"].numel():
        ri = plan["root_idx"]
        pieces.append(varlen_attention(q_BNSD.index_select(2, ri), k_BGSD.index_select(2, ri),
                                       v_BGSD.index_select(2, ri), plan["root_cu"], scale,
                                       dropout_p, mask=plan["root_mask"],
                                       path=plan["root_path"], index=plan["root_index"]))
    for g in plan["groups"]:
        (plo, phi), (lo, hi), n, width = g["prompt"], g["span"], g["n"], g["width"]

        def to_batch(x_1HSD, g=g, n=n, width=width):  # [n, H, width, D], right-padded
            x_HSD = x_1HSD[0]
            if g["index"] is not None:
                slots = x_HSD.new_zeros(x_HSD.shape[0], n * width, x_HSD.shape[2])
                x_HSD = slots.index_copy(1, g["index"], x_HSD)
            return x_HSD.reshape(x_HSD.shape[0], n, width, x_HSD.shape[2]).transpose(0, 1)

        def with_prompt(x_1GSD, n=n, plo=plo, phi=phi, lo=lo, hi=hi, to_batch=to_batch):
            own = to_batch(x_1GSD[:, :, lo:hi])
            return torch.cat([x_1GSD[:, :, plo:phi].expand(n, -1, -1, -1), own], dim=2)

        out_BNLD = F.scaled_dot_product_attention(
            to_batch(q_BNSD[:, :, lo:hi]), with_prompt(k_BGSD), with_prompt(v_BGSD),
            attn_mask=group_mask(g, q_BNSD.device), **kwargs)
        out_NSD = out_BNLD.transpose(0, 1).reshape(out_BNLD.shape[1], n * width, -1)
        if g["index"] is not None:
            out_NSD = out_NSD.index_select(1, g["index"])
        pieces.append(out_NSD.unsqueeze(0))
    out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
    return out.index_select(2, plan["inverse"])
