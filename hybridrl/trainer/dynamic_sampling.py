"""DAPO dynamic sampling (``algorithm.filter_groups``): generate until the batch holds enough
prompt groups whose scores differ, in a bounded number of rounds.

Contract:
- ``informative_groups(scores_N, uid_N)``: the uids whose n sequence scores are not all equal
  (non-zero std; for GRPO-like estimators a group of equal scores has advantage 0 everywhere).
  Pure.
- ``collect(trainer, prompts) -> (rollout batch, scores [N], reward metrics, metrics)``, every
  rank: round 1 generates and scores ``prompts`` (the step's batch, B prompts x ``rollout.n``);
  while fewer than B informative groups were kept and fewer than
  ``filter_groups.max_num_gen_batches`` rounds ran, the next B prompts of the loader are
  generated and scored (verl's DAPO loop). The batch is the first B informative groups in round
  order; when the rounds end short, it is filled with the last uninformative groups seen (zero
  advantage for GRPO-like estimators, so the step keeps its shape and optimizer-step count where
  verl would stop with an error). Reward metrics are those of round 1 (the policy's unfiltered
  samples). Metrics: ``dynamic_sampling/{rounds, informative_groups, dropped_groups,
  dropped_frac, filled_groups}``.
- Needs one DP replica (``parallel.dp == 1``: every rank holds every row, so no rows move
  between DP ranks after filtering), a rule / custom reward (not ``reward.reward_model_path``)
  and ``rollout.n >= 2``; otherwise ``check`` raises one ValueError line naming the key.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hybridrl.rollout.batch import RolloutBatch


def check(trainer) -> None:
    """ValueError (one line) when the run cannot use dynamic sampling."""
    cfg = trainer.cfg
    if trainer.groups.dp_size != 1:
        raise ValueError("algorithm.filter_groups.enable=true needs one DP replica "
                         f"(parallel.dp = 1); this layout has dp = {trainer.groups.dp_size}")
    if cfg.reward.reward_model_path:
        raise ValueError("algorithm.filter_groups.enable=true works with rule / custom rewards, "
                         "not reward.reward_model_path")
    if cfg.rollout.n < 2:
        raise ValueError("algorithm.filter_groups.enable=true needs rollout.n >= 2 (a group of "
                         f"one has no score spread); got rollout.n={cfg.rollout.n}")


def informative_groups(scores_N: torch.Tensor, uid_N: list) -> set:
    """uids whose scores are not all equal."""
    by_uid = defaultdict(list)
    for s, u in zip(scores_N.tolist(), uid_N):
        by_uid[u].append(s)
    return {u for u, vals in by_uid.items() if len(vals) > 1 and max(vals) > min(vals)}


def _rows_of(rb: RolloutBatch, uids: list, offset: int) -> list[tuple[int, int]]:
    """(row index, uid + offset) of each row of the groups ``uids``, group by group."""
    where = defaultdict(list)
    for j, u in enumerate(rb.uid):
        where[u].append(j)
    return [(j, u + offset) for u in uids for j in where[u]]


def _merge(picks: list[tuple[RolloutBatch, torch.Tensor, list[tuple[int, int]]]]):
    """One RolloutBatch (rows 0..N-1) and its scores from (batch, scores, [(row, uid)]) picks."""
    R = max(rb.response_ids.shape[1] for rb, _, _ in picks)

    def pad(t):
        return torch.nn.functional.pad(t, (0, R - t.shape[1]))

    cols = defaultdict(list)
    for rb, scores, rows in picks:
        idx = [j for j, _ in rows]
        cols["prompt_ids"] += [rb.prompt_ids[j] for j in idx]
        cols["uid"] += [u for _, u in rows]
        for name in ("ground_truth", "data_source", "extra_info"):
            cols[name] += [getattr(rb, name)[j] for j in idx]
        for name in ("response_ids", "response_mask", "rollout_logprobs"):
            cols[name].append(pad(getattr(rb, name)[idx]))
        cols["scores"].append(scores[idx])
    merged = RolloutBatch(cols["prompt_ids"], torch.cat(cols["response_ids"]),
                          torch.cat(cols["response_mask"]), torch.cat(cols["rollout_logprobs"]),
                          cols["uid"], cols["ground_truth"], cols["data_source"],
                          cols["extra_info"])
    return merged, torch.cat(cols["scores"])


def collect(trainer, prompts):
    """(rollout batch, scores, reward metrics, dynamic_sampling/* metrics); see the docstring."""
    check(trainer)
    fg, need, g = trainer.cfg.algorithm.filter_groups, len(prompts), trainer.groups
    kept, spare, first_metrics, seen, rounds = [], [], None, 0, 0
    while rounds < fg.max_num_gen_batches and sum(len(r) for _, _, r in kept) < need * \
            trainer.cfg.rollout.n:
        if rounds:
            prompts = trainer.loader.next_batch()
        rb = trainer._rollout(prompts)
        scores, metrics = trainer.dist_scorer.score(
            rb.rows, rb.response_ids, rb.response_mask, rb.ground_truth, rb.data_source,
            rb.extra_info, g.tp_rank + g.tp_size * g.pp_rank, g.tp_size * g.pp_size)
        first_metrics = first_metrics or metrics
        good = informative_groups(scores, rb.uid)
        order = list(dict.fromkeys(rb.uid))  # groups in first-seen order
        missing = need - sum(len(r) for _, _, r in kept) // trainer.cfg.rollout.n
        take = [u for u in order if u in good][:missing]
        offset = rounds * need  # uids stay distinct across rounds
        kept.append((rb, scores, _rows_of(rb, take, offset)))
        spare.append((rb, scores, _rows_of(rb, [u for u in order if u not in good], offset)))
        seen, rounds = seen + len(order), rounds + 1
    n = trainer.cfg.rollout.n
    found = sum(len(r) for _, _, r in kept) // n
    fill = []
    for rb, scores, rows in reversed(spare):  # the latest uninformative groups first
        room = (need - found) * n - sum(len(r) for _, _, r in fill)
        if room <= 0:
            break
        fill.append((rb, scores, rows[:room]))
    merged, scores = _merge([p for p in kept + fill if p[2]])
    trainer.partition = ([list(range(len(merged)))], merged.seq_lengths)  # dp = 1: one part
    found_all = sum(len(informative_groups(s, b.uid)) for b, s, _ in kept)
    return merged, scores, first_metrics, {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/informative_groups": float(found_all),
        "dynamic_sampling/dropped_groups": float(seen - found_all),
        "dynamic_sampling/dropped_frac": float(seen - found_all) / max(seen, 1),
        "dynamic_sampling/filled_groups": float(need - found),
    }
