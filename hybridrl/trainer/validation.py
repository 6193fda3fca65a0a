"""Greedy validation: generate on the validation prompts, score each once, keep every sample.

Contract: ``validate_prompts(worker, scorer, loader, groups, params, seed, tokenizer)``
(collective: every rank; the engine must hold the weights to evaluate, i.e. call
``worker.sync_weights`` first) generates each validation batch with ``params`` (partitioned over
the DP replicas like the trainer), scores every row once (``DistributedScorer``) and gathers the
per-row results on every rank. It returns ``(metrics, samples)``, the same on every rank:
``metrics`` holds ``val/score/mean`` (mean score over all prompts) and, under verl's names,
``val-core/<data_source>/reward/mean@1`` per data source; ``samples`` is one dict per prompt in
dataset order: ``index``, ``data_source``, ``prompt``, ``response`` (decoded, special tokens
skipped), ``ground_truth``, ``score``.
``validate_actor(worker, actor, scorer, loader, groups, rollout, seed, tokenizer, enter=None)``
(collective) is the loops' whole validation: the actor's weights to the engine, the
``rollout.val_temperature`` sampling parameters, ``validate_prompts``, the engine's memory
released; ``enter(phase)`` (the PPO loop's ``PhaseMemory.enter``) is called with ``"reshard"``
before the weight sync and ``"gen"`` before generating. Returns ``(metrics, samples)``.
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist

from hybridrl.data.batching import karmarkar_karp


def validate_prompts(worker, scorer, loader, groups, params, seed: int, tokenizer):
    """(metrics, samples) of greedy validation (see the module docstring)."""
    mp_index, mp_size = groups.tp_rank + groups.tp_size * groups.pp_rank, groups.tp_size * groups.pp_size
    mine, offset = [], 0
    for prompts in loader:  # each DP replica receives and scores its rows only
        rows, out, _ = worker.generate_partitioned(
            prompts.prompt_ids, params, seed=seed,
            plan_parts=lambda lens: karmarkar_karp(lens, groups.dp_size, equal_size=True))
        truth, source = [prompts.ground_truth[i] for i in rows], [prompts.data_source[i] for i in rows]
        scores, _ = scorer.score(rows, out.response_ids, out.response_mask, truth, source,
                                 [prompts.extra_info[i] for i in rows], mp_index, mp_size)
        if mp_index == 0:  # one rank per replica reports its rows
            for j, row in enumerate(rows):
                ids = out.response_ids[j][out.response_mask[j].bool()].tolist()
                mine.append({"index": offset + row, "data_source": source[j],
                             "prompt": tokenizer.decode(prompts.prompt_ids[row],
                                                        skip_special_tokens=True),
                             "response": tokenizer.decode(ids, skip_special_tokens=True),
                             "ground_truth": str(truth[j]), "score": float(scores[j])})
        offset += len(prompts)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    samples = sorted((s for part in everyone for s in part), key=lambda s: s["index"])
    by_source = defaultdict(list)
    for s in samples:
        by_source[s["data_source"]].append(s["score"])
    metrics = {"val/score/mean": sum(s["score"] for s in samples) / max(len(samples), 1)}
    for source, values in sorted(by_source.items()):
        metrics[f"val-core/{source}/reward/mean@1"] = sum(values) / len(values)
    return metrics, samples


def validate_actor(worker, actor, scorer, loader, groups, rollout, seed: int, tokenizer,
                   enter=None):
    """Sync, generate with ``rollout.val_temperature``, score, release (see the docstring)."""
    if enter is not None:
        enter("reshard")
    worker.sync_weights(actor)
    if enter is not None:
        enter("gen")
    params = worker.sampling_params(rollout.response_length, rollout.val_temperature,
                                    rollout.top_k, rollout.top_p)
    out = validate_prompts(worker, scorer, loader, groups, params, seed, tokenizer)
    worker.release()
    return out
