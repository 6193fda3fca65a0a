"""The builtin engine's ``generate``: prefill (identical prompts once, kept caches continued),
then the decode loop with the compaction of finished rows.

Contract:
- ``generate_rows(engine, prompts, params, resume=None, keep=False)`` -> (``ids`` [B, R],
  ``mask`` [B, R], ``logp`` [B, R], ``routed`` [B, P + R, layers, k] or None, ``kept``): what
  ``BuiltinEngine.generate`` returns (``hybridrl.rollout.base``), P = the longest prompt.
- Cache layout: one KV cache of [B, hk, W + R, hd] per layer, W = Kmax + N: row b's reused
  columns (``k_b`` tokens of ``resume[b]``) right-aligned in [0, Kmax), its new tokens
  (``n_b`` = the rest of its prompt) right-aligned in [Kmax, W), its response in [W, W + R).
  Every column is a key only where it holds a real token of the row (``valid``), and positions
  count real tokens, so the gaps (padding, a shorter reused part) change nothing: a row's
  tokens and log-probs are those of prefilling its whole prompt (up to matmul rounding).
  A fresh call (no ``resume``) is the plain left-padded prompt batch, Kmax = 0.
- Shared prefill (``engine.share_prefill``, default on): rows that reuse nothing and whose prompt
  token lists are identical are prefilled once, their KV rows (and, for a MoE model, the
  prompt's top-k expert ids) copied to the others before the first sample; a GRPO batch of
  n samples per prompt prefills each prompt once instead of n times. Sampling is per row as
  before (a row's generator, or the batch's generator over the same rows in the same order).
- Continuation: ``resume[b]`` is a ``KeptRow`` (or None): the tokens whose K/V a previous call
  left and that K/V; the row reuses the longest common prefix of those tokens and its prompt
  (at most its prompt length - 1: the last prompt token is always forwarded, its hidden state
  gives the first sample) and prefills only the rest. ``engine.prefilled`` counts the real
  tokens prefilled (shared rows once).
- ``keep``: every row that ended on a stop id (eos or ``params.stop_token_ids``) returns in
  ``kept`` (batch index -> ``KeptRow``) with the K/V of its prompt and response except its
  last token (never forwarded; the next call prefills it) - copies of the rows the call
  already held, taken when the row leaves the batch (compaction) or at the end. Rows cut by
  ``max_new_tokens`` are not kept (an agent loop ends them).
"""

from __future__ import annotations

import dataclasses

import torch

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.builtin.moe import RoutingRecord
from hybridrl.rollout.sampling import sample_next


@dataclasses.dataclass
class KeptRow:
    """One sequence's K/V left by a ``generate`` call (see the module docstring)."""

    tokens: list[int]  # the tokens whose K/V the row holds, in order
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [hk, n, hd]
    routed: torch.Tensor | None = None  # MoE: [n, layers, k] int16 top-k expert ids

    def __len__(self) -> int:
        return len(self.tokens)


def _reused(row: KeptRow | None, prompt: list[int]) -> int:
    """Tokens of ``row`` that ``prompt`` starts with (never the prompt's last token)."""
    if row is None:
        return 0
    n, limit = 0, min(len(row.tokens), len(prompt) - 1)
    while n < limit and row.tokens[n] == prompt[n]:
        n += 1
    return n


def _representatives(prompts, reuse, share: bool) -> tuple[list[int], list[int]]:
    """(rows to prefill, each row's index among them): identical fresh prompts once."""
    reps, inv, first = [], [], {}
    for b, p in enumerate(prompts):
        key = tuple(p) if share and reuse[b] == 0 else ("row", b)
        if key not in first:
            first[key] = len(reps)
            reps.append(b)
        inv.append(first[key])
    return reps, inv


def _prefill(engine, prompts, resume, reuse, reps, R: int, pad: int):
    """Prefill the representatives: (cache, valid [U, W + R], record, h [U, H], next pos [U], W)."""
    spec, dev = engine.spec, engine.device
    U, Kmax = len(reps), max(reuse[b] for b in reps)
    N = max(len(prompts[b]) - reuse[b] for b in reps)
    W = Kmax + N
    cache = engine._new_cache(U, W + R)
    valid_UT = torch.zeros(U, W + R, dtype=torch.bool, device=dev)
    ids_UN = torch.full((U, N), pad, dtype=torch.long, device=dev)
    record = (RoutingRecord(U, W + R, spec.num_layers, spec.moe_topk, dev)
              if spec.num_experts else None)
    for u, b in enumerate(reps):
        k, new = reuse[b], prompts[b][reuse[b]:]
        if k:
            for (keys, values), (k_old, v_old) in zip(cache, resume[b].kv):
                keys[u, :, Kmax - k:Kmax] = k_old[:, :k]
                values[u, :, Kmax - k:Kmax] = v_old[:, :k]
            valid_UT[u, Kmax - k:Kmax] = True
            if record is not None:
                record.ids[u, Kmax - k:Kmax] = resume[b].routed[:k]
        ids_UN[u, N - len(new):] = torch.tensor(new, dtype=torch.long)
        valid_UT[u, W - len(new):W] = True
    engine.prefilled += sum(len(prompts[b]) - reuse[b] for b in reps)
    pos_UN = (valid_UT[:, :W].long().cumsum(-1) - 1).clamp(min=0)[:, Kmax:]
    cols, q = torch.arange(W, device=dev), torch.arange(Kmax, W, device=dev)
    causal_NW = cols[None, :] <= q[:, None]
    allowed = causal_NW & (valid_UT[:, None, :W] | (cols[None, :] == q[:, None]))
    h = engine.forward(ids_UN, pos_UN, cache, Kmax, allowed, record,
                       torch.arange(U, device=dev))[:, -1]
    return cache, valid_UT, record, h, pos_UN[:, -1] + 1, W


def _keep_row(prompt, out_ids_R, valid_T, W: int, cache, i: int, record, b: int) -> KeptRow:
    """Row ``b`` (at ``i`` in the live cache) without its last token: copies of its K/V."""
    cols = torch.nonzero(valid_T).flatten()[:-1]
    n_resp = int(valid_T[W:].sum())
    return KeptRow(list(prompt) + out_ids_R[:n_resp - 1].tolist(),
                   [(k[i].index_select(1, cols), v[i].index_select(1, cols)) for k, v in cache],
                   None if record is None else record.ids[b].index_select(0, cols))


def _check(spec, prompts, params: SamplingParams, resume) -> None:
    B, P, R = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
    if P + R > spec.max_seq_len:
        raise ValueError(f"prompt length {P} + max_new_tokens {R} exceeds the engine's "
                         f"max_seq_len={spec.max_seq_len}")
    if any(t < 0 or t >= spec.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt_ids hold ids outside [0, {spec.vocab_size})")
    if params.row_seeds is not None and len(params.row_seeds) != B:
        raise ValueError(f"row_seeds has {len(params.row_seeds)} seeds for {B} prompts")
    if resume is not None and len(resume) != B:
        raise ValueError(f"resume has {len(resume)} rows for {B} prompts")


def generate_rows(engine, prompts: list[list[int]], params: SamplingParams, resume=None,
                  keep: bool = False):
    """Sample responses (see the module docstring); runs under the caller's inference_mode."""
    B, P, R = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
    _check(engine.spec, prompts, params, resume)
    resume = resume or [None] * B
    reuse = [_reused(r, p) for r, p in zip(resume, prompts)]
    reps, inv = _representatives(prompts, reuse, engine.share_prefill)
    cache, valid_BT, record, h, next_pos_b, W = _prefill(engine, prompts, resume, reuse, reps, R,
                                                         params.pad_token_id)
    resume[:] = [None] * B  # the kept K/V now lives in the new cache: freed during the decode
    dev = engine.device
    if len(reps) < B:  # copy the shared rows' K/V, routing and last state to their duplicates
        idx = torch.tensor(inv, device=dev)
        cache = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in cache]
        valid_BT, h, next_pos_b = valid_BT[idx], h[idx], next_pos_b[idx]
        if record is not None:
            record.ids = record.ids.index_select(0, idx)
    if params.row_seeds is not None:  # one generator per request
        generator = [torch.Generator(device=dev).manual_seed(int(s)) for s in params.row_seeds]
    else:
        generator = torch.Generator(device=dev).manual_seed(int(params.seed))
    out_ids = torch.full((B, R), params.pad_token_id, dtype=torch.long, device=dev)
    out_logp = torch.zeros(B, R, dtype=torch.float32, device=dev)
    done_b = torch.zeros(B, dtype=torch.bool, device=dev)
    live = torch.arange(B, device=dev)  # the batch's rows still decoded (see compact_at)
    kept, steps = {}, 0
    cols = torch.arange(W + R, device=dev)
    stops = torch.tensor(params.stop_ids, device=h.device) if params.stop_ids else None

    def keep_rows(positions):
        for i in positions:
            b = int(live[i])
            kept[b] = _keep_row(prompts[b], out_ids[b], valid_BT[b], W, cache, i, record, b)

    for j in range(R):
        tokens_b, logp_b = sample_next(engine.logits(h), params, generator)
        tokens_b = engine._sync_tokens(tokens_b.masked_fill(done_b, params.pad_token_id))
        out_ids[live, j] = tokens_b
        out_logp[live, j] = logp_b.masked_fill(done_b, 0.0)
        valid_BT[live, W + j] = ~done_b
        steps = j + 1
        if stops is not None:  # eos and the stop ids end a row (the token is kept)
            done_b = done_b | torch.isin(tokens_b, stops)
        if bool(done_b.all()) or j == R - 1:
            break
        if int(done_b.sum()) >= engine.compact_at * len(live) > 0:  # drop the finished rows
            if keep:
                keep_rows(torch.nonzero(done_b).flatten().tolist())
            rest = torch.nonzero(~done_b).flatten()  # the same on every TP rank (synced)
            cache = [(k.index_select(0, rest), v.index_select(0, rest)) for k, v in cache]
            live, tokens_b, next_pos_b = live[rest], tokens_b[rest], next_pos_b[rest]
            done_b = done_b[rest]
            if isinstance(generator, list):
                generator = [generator[i] for i in rest.tolist()]
        c = W + j
        allowed = (valid_BT[live, : c + 1] | (cols[: c + 1] == c)).unsqueeze(1)  # [b, 1, K]
        h = engine.forward(tokens_b[:, None], next_pos_b[:, None], cache, c, allowed, record,
                           live)[:, -1]
        next_pos_b = next_pos_b + 1
    if keep:
        keep_rows(torch.nonzero(done_b).flatten().tolist())
    mask = valid_BT[:, W:W + steps].long()
    routed = None if record is None else record.aligned(valid_BT, P + steps)
    return (out_ids[:, :steps] * mask + params.pad_token_id * (1 - mask), mask,
            out_logp[:, :steps] * mask, routed, kept)
