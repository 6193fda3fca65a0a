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
- At dp > 1 each DP replica generates and scores only its rows of a round (the trainer's
  partition); the scores and response lengths of every row (scalars) are all-gathered over the
  DP group, so every rank takes the same decisions as one process would. The kept rows are
  then re-balanced: the merged batch is cut over the DP replicas by
  ``plan_rollout_partition`` on its sequence lengths (``trainer.partition_shape()``'s chunk
  and group, as a step without filtering), and each row moves once from a rank of the replica
  that generated it to every rank of the replica that trains on it
  (``partition.exchange_rollouts``: int32 ids + fp32 log-probs, point to point). The result
  equals dp 1's on the same seeds (tests/distributed/test_async_handoff.py).
- Needs a rule / custom reward (not ``reward.reward_model_path``) and ``rollout.n >= 2``;
  otherwise ``check`` raises one ValueError line naming the key. The per-row ``loss_mask`` and
  ``routed_experts`` are kept in the merged batch at dp 1 (padded to the widest round); at
  dp > 1 the exchange moves ids, log-probs and, from a MoE engine, each row's routed expert
  ids (``exchange_rollouts(routing=...)``, as the colocated hand-off moves them); the loss
  mask is read back from the moved ids (a multi-turn worker's ``loss_mask``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from hybridrl.rollout.base import GenerationOutput
from hybridrl.rollout.batch import RolloutBatch
from hybridrl.rollout.partition import exchange_rollouts, plan_rollout_partition, plan_transfers


def check(trainer) -> None:
    """ValueError (one line) when the run cannot use dynamic sampling."""
    cfg = trainer.cfg
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
        for name in ("response_ids", "response_mask", "rollout_logprobs", "loss_mask"):
            if getattr(rb, name) is not None:
                cols[name].append(pad(getattr(rb, name)[idx]))
        if rb.routed_experts is not None:  # [rows, P + R, layers, k]
            cols["routed_experts"].append(rb.routed_experts[idx])
        cols["scores"].append(scores[idx])
    routed = None
    if cols.get("routed_experts"):  # pad the token axis to the longest round's
        width = max(t.shape[1] for t in cols["routed_experts"])
        routed = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, 0, 0, width - t.shape[1]))
                            for t in cols["routed_experts"]])
    merged = RolloutBatch(cols["prompt_ids"], torch.cat(cols["response_ids"]),
                          torch.cat(cols["response_mask"]), torch.cat(cols["rollout_logprobs"]),
                          cols["uid"], cols["ground_truth"], cols["data_source"],
                          cols["extra_info"],
                          loss_mask=torch.cat(cols["loss_mask"]) if cols.get("loss_mask") else None,
                          routed_experts=routed)
    return merged, torch.cat(cols["scores"])


def _global_round(trainer, rb: RolloutBatch, scores: torch.Tensor, n_rows: int):
    """(scores [N], response lengths [N], DP replica of each row) of a round's whole batch, the
    same on every rank (dp 1: this rank's rows are the batch)."""
    lens = rb.response_mask.sum(-1).tolist()
    if trainer.groups.dp_size == 1:
        return scores, lens, [0] * n_rows
    seen = [None] * trainer.groups.dp_size
    dist.all_gather_object(seen, (trainer.groups.dp_rank, rb.rows, scores.tolist(), lens),
                           group=trainer.groups.gloo_dp)
    all_scores, all_lens, holder = [0.0] * n_rows, [0] * n_rows, [0] * n_rows
    for d, rows, vals, row_lens in seen:
        for row, v, n in zip(rows, vals, row_lens):
            all_scores[row], all_lens[row], holder[row] = v, int(n), d
    return torch.tensor(all_scores, dtype=scores.dtype), all_lens, holder


def collect(trainer, prompts):
    """(rollout batch, scores, reward metrics, dynamic_sampling/* metrics); see the docstring."""
    check(trainer)
    fg, need, g = trainer.cfg.algorithm.filter_groups, len(prompts), trainer.groups
    n = trainer.cfg.rollout.n
    kept, spare, first_metrics, seen, rounds, made = [], [], None, 0, 0, []
    while rounds < fg.max_num_gen_batches and sum(len(r) for _, _, r in kept) < need * n:
        if rounds:
            prompts = trainer.loader.next_batch()
        rb = trainer._rollout(prompts)
        scores, metrics = trainer.dist_scorer.score(
            rb.rows, rb.response_ids, rb.response_mask, rb.ground_truth, rb.data_source,
            rb.extra_info, g.tp_rank + g.tp_size * g.pp_rank, g.tp_size * g.pp_size)
        first_metrics = first_metrics or metrics
        if g.dp_size > 1:  # the whole round's scalars; uids are prompt indices, rows i*n..i*n+n-1
            all_scores, lens, holder = _global_round(trainer, rb, scores, len(prompts) * n)
            uids = [i for i in range(len(prompts)) for _ in range(n)]
            view = RolloutBatch([[]] * len(uids), rb.response_ids[:0], rb.response_mask[:0],
                                rb.rollout_logprobs[:0], uids, [], [], [], rows=list(range(len(uids))))
            rb_view, scores_view = view, all_scores
            made.append((prompts, rb, lens, holder, view))
        else:
            rb_view, scores_view = rb, scores
        good = informative_groups(scores_view, rb_view.uid)
        order = list(dict.fromkeys(rb_view.uid))  # groups in first-seen order
        missing = need - sum(len(r) for _, _, r in kept) // n
        take = [u for u in order if u in good][:missing]
        offset = rounds * need  # uids stay distinct across rounds
        kept.append((rb_view, scores_view, _rows_of(rb_view, take, offset)))
        spare.append((rb_view, scores_view, _rows_of(rb_view, [u for u in order if u not in good],
                                                     offset)))
        seen, rounds = seen + len(order), rounds + 1
    found = sum(len(r) for _, _, r in kept) // n
    fill = []
    for rb, scores, rows in reversed(spare):  # the latest uninformative groups first
        room = (need - found) * n - sum(len(r) for _, _, r in fill)
        if room <= 0:
            break
        fill.append((rb, scores, rows[:room]))
    picks = [p for p in kept + fill if p[2]]
    if g.dp_size > 1:
        merged, scores = _rebalance(trainer, picks, made)
    else:
        merged, scores = _merge(picks)
        trainer.partition = ([list(range(len(merged)))], merged.seq_lengths)  # dp = 1: one part
    found_all = sum(len(informative_groups(s, b.uid)) for b, s, _ in kept)
    return merged, scores, first_metrics, {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/informative_groups": float(found_all),
        "dynamic_sampling/dropped_groups": float(seen - found_all),
        "dynamic_sampling/dropped_frac": float(seen - found_all) / max(seen, 1),
        "dynamic_sampling/filled_groups": float(need - found),
    }


def _rebalance(trainer, picks, made):
    """(this DP rank's rows of the merged batch, their scores) at dp > 1: the merged rows cut
    over the DP replicas and moved there (see the module docstring)."""
    g, rank = trainer.groups, trainer.rank
    round_of = {id(view): r for r, (_, _, _, _, view) in enumerate(made)}
    entries = []  # merged row m -> (round, row of that round, uid + offset, score)
    for view, scores, rows in picks:
        r = round_of[id(view)]
        entries += [(r, row, u, float(scores[row])) for row, u in rows]
    n = trainer.cfg.rollout.n
    resp = [made[r][2][row] for r, row, _, _ in entries]
    prompt_lens = [len(made[r][0].prompt_ids[row // n]) for r, row, _, _ in entries]
    seq_lens = [p + q for p, q in zip(prompt_lens, resp)]
    chunk, group = trainer.partition_shape()
    parts = plan_rollout_partition(seq_lens, g.dp_size, chunk, group)
    trainer.partition = (parts, seq_lens)
    world = dist.get_world_size()
    replicas = [[q for q in range(world) if g.train.coords(q)["dp"] == d]
                for d in range(g.dp_size)]
    owner = [replicas[made[r][3][row]][0] for r, row, _, _ in entries]
    src_rows = [m for m, o in enumerate(owner) if o == rank]
    routed = made[0][1].routed_experts  # a MoE engine's ids (every rank's rounds alike)
    routing = None if routed is None else tuple(routed.shape[2:])  # (layers, k)
    src_out = None
    if src_rows:  # this rank's rows that others (or it) train on, from its rounds' batches
        positions = [{row: j for j, row in enumerate(m[1].rows)} for m in made]
        cols = []
        for m in src_rows:
            r, row = entries[m][:2]
            rb = made[r][1]
            j = positions[r][row]
            cols.append((rb.response_ids[j], rb.response_mask[j], rb.rollout_logprobs[j],
                         None if routing is None else rb.routed_experts[j]))

        def stack(k, fill=0):
            width = max(c[k].shape[0] for c in cols)
            return torch.stack([torch.cat([c[k], c[k].new_full((width - c[k].shape[0],
                                                                *c[k].shape[1:]), fill)])
                                for c in cols])

        src_out = GenerationOutput(stack(0), stack(1), stack(2),
                                   routed_experts=None if routing is None else stack(3, -1))
    mine = parts[g.dp_rank]
    out, moved = exchange_rollouts(rank, plan_transfers(owner, parts, replicas), mine, src_rows,
                                   src_out, resp, int(trainer.tokenizer.pad_token_id),
                                   trainer.actor.device, routing=routing, prompt_lens=prompt_lens)
    if hasattr(trainer, "transport"):  # the re-balance's bytes count in rollout/handoff_bytes
        trainer.transport += moved
    picked = [entries[m] for m in mine]
    pb = [(made[r][0], row // n) for r, row, _, _ in picked]
    merged = RolloutBatch([b.prompt_ids[i] for b, i in pb], out.response_ids, out.response_mask,
                          out.logprobs, [u for _, _, u, _ in picked],
                          [b.ground_truth[i] for b, i in pb], [b.data_source[i] for b, i in pb],
                          [b.extra_info[i] for b, i in pb], rows=mine,
                          routed_experts=out.routed_experts)
    derive = getattr(getattr(trainer, "worker", None), "loss_mask", None)  # multi-turn: from ids
    if derive is not None:
        merged.loss_mask = derive(merged.response_ids, merged.response_mask)
    return merged, torch.tensor([sc for *_, sc in picked], dtype=picks[0][1].dtype)
