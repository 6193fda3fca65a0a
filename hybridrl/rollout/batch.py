"""A step's rollout batch on the training side, and its megatron micro-batches.

Contract:
- ``RolloutBatch`` holds N sequences (each prompt repeated ``rollout.n`` times, consecutive):
  unpadded ``prompt_ids``, right-padded ``response_ids`` / ``response_mask`` / engine
  ``rollout_logprobs`` [N, R], the prompt group ``uid`` [N] (for GRPO), and what the reward
  needs (``ground_truth``, ``data_source``, ``extra_info``). Per-token training tensors
  (old/ref log-probs, values, advantages, returns) live beside it as [N, R] tensors. On a DP
  rank it holds only that rank's rows: ``rows`` are their indices in the step's batch
  (ascending; ``range(N)`` for a whole batch).
  Optional per-row tensors: ``loss_mask`` [N, R] (the response tokens the losses see: a
  multi-turn rollout's own model tokens; None = ``response_mask``) and ``routed_experts``
  [N, P + R, layers, k] (a MoE engine's top-k expert ids per token, for routing replay).
- ``subset(idx)``: rows ``idx`` as a batch of their own (``rows`` and the optional tensors kept).
- ``microbatch(idx, tensors)``: the megatron input for rows ``idx``: ``input_ids`` [b, T]
  right-padded (prompt then response, starting at position 0 as megatron's RoPE needs, T = the
  longest prompt + response among the rows), ``resp_index`` [b, R] = the output positions that
  score each response token (prompt_len - 1 + j: position t scores token t + 1),
  ``response_mask`` [b, R], ``seq_lens`` [b] (real tokens of each row), plus ``tensors[k][idx]``
  for each given [N, R] tensor. With ``packed=True`` the rows are one pack
  (``hybridrl.models.packing``): ``input_ids`` [1, S] (S = the sum of the rows' lengths, no pad
  token), ``cu_seqlens`` [b + 1], and ``resp_index`` [b, R] points into the pack (row b's start
  + prompt_len - 1 + j, clamped to its last token, so a masked column never reads another
  sequence): losses read both layouts alike through ``gather_response``. Rows of one length
  have no padding to remove: ``packed=True`` then returns the padded layout (the same tokens,
  the same budget, no per-sequence bookkeeping: ``pack_pays``).
  With ``packed=True, share=True`` (``model.share_prompts``) rows of ``idx`` with one prompt
  (``shared_groups``: 2+ rows, a prompt of 2+ tokens) are laid out as [the prompt but its last
  token] then, per row, [the prompt's last token, its response]: the prompt is computed once,
  and each row's first response token is still scored at a position of its own (the repeated
  last prompt token), so labels stay "the next token". The pack then also carries
  ``seg_parent`` [n segments] (a response segment's prompt segment, -1 for the prompt and for
  rows of their own) and ``position_ids`` [S] (prompt 0..P-2, each response segment P-1..);
  ``resp_index`` of a shared row starts at its segment (clamped to it), ``seq_lens`` stays the
  rows' own lengths. Micro-batches without such rows are as above.
- ``batch_metrics(rb, tensors, max_response_length, step_s, world, dp_group, device)``:
  response/prompt lengths, advantage/return means and the |engine - actor| log-prob gap (mean,
  max) over the tokens the losses see (``loss_mask`` when present),
  tokens and tokens/s per rank; with ``dp_group`` every value is over the whole batch (sums,
  counts, max and min all-reduced over the DP ranks' shards, on ``device``).
- ``gather_response(out_bT, resp_index_bR)`` picks the response columns [b, R] out of a per-token
  model output [b, T], or out of a pack's [1, S].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.models.packing import pack_sequences


@dataclasses.dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # N unpadded prompts
    response_ids: torch.Tensor  # [N, R] int64, right-padded
    response_mask: torch.Tensor  # [N, R] int64
    rollout_logprobs: torch.Tensor  # [N, R] fp32 (the engine's)
    uid: list[int]  # [N] prompt group of each sequence
    ground_truth: list[Any]
    data_source: list[str]
    extra_info: list[dict]
    rows: list[int] | None = None  # indices in the step's batch; None = range(N)
    loss_mask: torch.Tensor | None = None  # [N, R]: the tokens the losses see (a multi-turn
    # rollout's model tokens; tool output and template tokens 0); None = response_mask
    routed_experts: torch.Tensor | None = None  # [N, P + R, layers, k] int: the engine's top-k
    # expert ids per token of a MoE model (prompt and response), for routing replay; or None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = list(range(len(self.prompt_ids)))

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)  # [N]

    @property
    def seq_lengths(self) -> list[int]:
        """Prompt + response tokens of each sequence (for token-budget micro-batches)."""
        return [len(p) + int(r) for p, r in zip(self.prompt_ids, self.response_lengths)]

    def subset(self, idx: list[int]) -> RolloutBatch:
        """Rows ``idx`` (positions in this batch) as a batch of their own; ``rows`` keeps their
        indices in the step's batch."""
        sel = torch.as_tensor(idx, dtype=torch.long)
        return RolloutBatch([self.prompt_ids[i] for i in idx], self.response_ids[sel],
                            self.response_mask[sel], self.rollout_logprobs[sel],
                            [self.uid[i] for i in idx], [self.ground_truth[i] for i in idx],
                            [self.data_source[i] for i in idx], [self.extra_info[i] for i in idx],
                            rows=[self.rows[i] for i in idx],
                            loss_mask=None if self.loss_mask is None else self.loss_mask[sel],
                            routed_experts=(None if self.routed_experts is None
                                            else self.routed_experts[sel]))

    def microbatch(self, idx: list[int], tensors: dict[str, torch.Tensor] | None = None,
                   pad_token_id: int = 0, packed: bool = False,
                   share: bool = False) -> dict[str, torch.Tensor]:
        """The megatron micro-batch of rows ``idx`` (see the module docstring)."""
        if not idx:
            raise ValueError("a micro-batch needs at least one row, got 0")
        lens = [len(self.prompt_ids[i]) + int(self.response_mask[i].sum()) for i in idx]
        if packed and share and shared_groups([self.prompt_ids[i] for i in idx]):
            return self._packed(idx, tensors, share=True)
        if packed and pack_pays(lens):
            return self._packed(idx, tensors)
        rows = torch.as_tensor(idx, dtype=torch.long)
        R = self.response_ids.shape[1]
        T = max(lens)
        input_ids_bT = torch.full((len(idx), T), pad_token_id, dtype=torch.long)
        resp_index_bR = torch.empty(len(idx), R, dtype=torch.long)
        for b, i in enumerate(idx):
            p = self.prompt_ids[i]
            r = self.response_ids[i, : int(self.response_mask[i].sum())]
            input_ids_bT[b, : len(p)] = torch.tensor(p, dtype=torch.long)
            input_ids_bT[b, len(p): len(p) + len(r)] = r
            resp_index_bR[b] = (len(p) - 1 + torch.arange(R)).clamp(max=T - 1)
        out = {"input_ids": input_ids_bT, "resp_index": resp_index_bR,
               "response_mask": self.response_mask[rows],
               "seq_lens": torch.tensor(lens, dtype=torch.long)}
        for key, value in (tensors or {}).items():
            out[key] = value[rows]
        return out

    def _packed(self, idx: list[int], tensors: dict[str, torch.Tensor] | None,
                share: bool = False) -> dict:
        """Rows ``idx`` as one pack [1, S]; ``share``: each shared prompt once (module doc)."""
        rows = torch.as_tensor(idx, dtype=torch.long)
        R = self.response_ids.shape[1]
        prompts = [torch.tensor(self.prompt_ids[i], dtype=torch.long) for i in idx]
        resps = [self.response_ids[i, : int(self.response_mask[i].sum())] for i in idx]
        groups = shared_groups([self.prompt_ids[i] for i in idx]) if share else []
        member = {b: g for g in groups for b in g}
        segs, parents, pos, first = [], [], [], {}  # first[b]: (start, length) of row b's read
        start = 0

        def add(tokens, parent, p0):
            nonlocal start
            segs.append(tokens)
            parents.append(parent)
            pos.append(torch.arange(p0, p0 + len(tokens)))
            start += len(tokens)
            return start - len(tokens)

        for b in range(len(idx)):
            if b in first:
                continue
            if b not in member:  # a whole sequence of its own
                at = add(torch.cat([prompts[b], resps[b]]), -1, 0)
                first[b] = (at + len(prompts[b]) - 1, len(prompts[b]) + len(resps[b]))
                continue
            prompt = prompts[b]
            p = len(segs)
            add(prompt[:-1], -1, 0)  # the shared prompt but its last token
            for j in member[b]:  # each response after the prompt's last token
                at = add(torch.cat([prompt[-1:], resps[j]]), p, len(prompt) - 1)
                first[j] = (at, 1 + len(resps[j]))
        input_ids_1S, cu = pack_sequences(segs)
        head = torch.tensor([first[b][0] for b in range(len(idx))], dtype=torch.long)
        span = torch.tensor([first[b][1] for b in range(len(idx))], dtype=torch.long)
        resp_index_bR = head.unsqueeze(1) + torch.arange(R)  # [b, R]
        seq_start = head - torch.tensor([0 if b in member else len(prompts[b]) - 1
                                         for b in range(len(idx))])
        resp_index_bR = torch.minimum(resp_index_bR, (seq_start + span - 1).unsqueeze(1))
        lens = torch.tensor([len(prompts[b]) + len(resps[b]) for b in range(len(idx))])
        out = {"input_ids": input_ids_1S, "cu_seqlens": cu, "resp_index": resp_index_bR,
               "response_mask": self.response_mask[rows], "seq_lens": lens}
        if groups:
            out["seg_parent"] = torch.tensor(parents, dtype=torch.long)
            out["position_ids"] = torch.cat(pos)
        for key, value in (tensors or {}).items():
            out[key] = value[rows]
        return out


def shared_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Positions of the rows that share a prompt (at least 2 rows, a prompt of at least 2
    tokens: its last token starts each response's segment), each group in row order."""
    by = {}
    for b, p in enumerate(prompts):
        if len(p) >= 2:
            by.setdefault(tuple(p), []).append(b)
    return [g for g in by.values() if len(g) >= 2]


def pack_pays(lens: list[int]) -> bool:
    """True when packing rows of these lengths removes padding (they are not all one length)."""
    return min(lens) != max(lens)


def gather_response(out_bT: torch.Tensor, resp_index_bR: torch.Tensor) -> torch.Tensor:
    """Response columns [b, R] of a per-token output [b, T] (or of a pack's [1, S])."""
    if out_bT.shape[0] == 1 and resp_index_bR.shape[0] > 1:  # a pack: every row reads the same
        out_bT = out_bT.expand(resp_index_bR.shape[0], -1)
    return out_bT.gather(1, resp_index_bR.to(out_bT.device))


def batch_metrics(rb: RolloutBatch, tensors: dict, max_response_length: int, step_s: float,
                  world: int, dp_group=None, device="cpu") -> dict[str, float]:
    """Batch statistics of one step over every DP rank's rows (see the module docstring)."""
    m = (rb.response_mask if rb.loss_mask is None else rb.loss_mask).float()  # model tokens
    lens = rb.response_lengths.float()
    gap = (rb.rollout_logprobs - tensors["old_log_probs"]).abs() * m  # [N, R] engine vs actor
    sums = torch.tensor([
        float(lens.sum()), float((lens >= max_response_length).sum()),
        float(sum(len(p) for p in rb.prompt_ids)), float(len(rb)), float(m.sum()),
        float((tensors["advantages"] * m).sum()), float((tensors["returns"] * m).sum()),
        float(gap.sum()), float(sum(rb.seq_lengths))], dtype=torch.float64)
    peaks = torch.tensor([float(lens.max()), float(gap.max())], dtype=torch.float64)
    if dp_group is not None:
        sums, peaks = sums.to(device), peaks.to(device)
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=dp_group)
    (len_sum, clipped, prompt_sum, n, n_tok, adv, ret, gap_sum, tokens) = sums.tolist()
    n_tok = max(n_tok, 1.0)
    return {
        "response_length/mean": len_sum / n, "response_length/max": float(peaks[0]),
        "response_length/clip_ratio": clipped / n,
        "prompt_length/mean": prompt_sum / n,
        "critic/advantages/mean": adv / n_tok,
        "critic/returns/mean": ret / n_tok,
        "training/rollout_logprob_diff": gap_sum / n_tok,
        "training/rollout_logprob_diff_max": float(peaks[1]),
        "perf/total_tokens": tokens,
        "perf/throughput": tokens / max(step_s, 1e-9) / world,
    }
