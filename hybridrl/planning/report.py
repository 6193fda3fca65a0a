"""A run config as a memory job, and the memory plan as the text ``hybridrl plan --memory`` prints.

Contract:
- ``job_from_config(cfg, shape, world, gpu_gb, **overrides)``: the ``MemoryJob`` of a hybridrl
  config (``HybridRLConfig``) on ``world`` GPUs: its layouts, dtype, token budgets (a fixed
  micro-batch counts micro x the longest sequence; forward-only passes the ``ref`` section's
  budget, values the critic's), recompute / sequence parallel, offload flags (the actor's),
  roles, rollout size, SGLang's ``mem_fraction_static`` (``rollout.engine_kwargs`` first, then
  ``rollout.mem_fraction_static``, else 0.5, SGLang's default here), the KL guard
  (``trainer.kl_guard.max_kl > 0``), the micro-batches per pipeline of one mini-batch
  (``micro_batches_per_pipeline``) and, for MoE models, ``parallel.ep`` / ``parallel.etp``.
- ``micro_batches_per_pipeline(role_cfg, sequences, dp, seq_len, pp=1)``: a mini-batch of ``role_cfg``
  (``ppo_mini_batch_size`` x ``rollout.n`` sequences, over ``dp`` ranks) in micro-batches of
  ``ppo_micro_batch_size_per_gpu`` sequences, or with ``use_dynamic_bsz`` as many full-length
  sequences as ``ppo_max_token_len_per_gpu`` holds (the worst case: every row at full length).
  With ``mean_len`` (packed sequences, ``model.pack_sequences``) a token-budget micro-batch is
  a pack of real tokens: ceil(sequences x mean_len / budget).
- ``format_report(rep, title)``: one row per phase (parts in GB, worst pipeline stage), for MoE
  the expert layout and one MoE layer's router logits / dispatcher buffers / expert tensors per
  micro-batch (``moe_line``), the KV pool, the pipeline bubble (``bubble_lines``: a WARNING line above 25 %), the padding line
  (``rep["padding"]``, from a run config), the snapshot's host bytes, where the reshard's bytes
  travel (``reshard_traffic``, when the report has it), the verdict.
- ``padding_line(cfg, dp)``: what the training forwards pad; packed, the packs per pipeline
  and their bubble when the mean sequence is half the longest (packs follow the real tokens:
  fewer micro-batches, a larger bubble). ``pipeline_lines(cfg, dp)``: what the trainer prints
  at start-up: micro-batches per pipeline (full-length sequences), bubble, padding.
"""

from __future__ import annotations

import math

from hybridrl.planning.memory import GB, MemoryJob, bubble_report
from hybridrl.planning.moe_memory import MOE_NOTE
from hybridrl.reshard.specs import LlamaShape


def micro_batches_per_pipeline(role_cfg, n: int, dp: int, seq_len: int,
                               mean_len: float | None = None, pp: int = 1) -> int:
    """Micro-batches one pipeline runs per mini-batch of ``role_cfg`` (see the docstring); a
    token-budget plan makes at least ``pp`` where the rows allow (the trainer's floor)."""
    seqs = max(role_cfg.ppo_mini_batch_size * n // dp, 1)
    floor = min(pp, seqs) if role_cfg.use_dynamic_bsz else 1
    if mean_len is not None and role_cfg.use_dynamic_bsz:  # packs: real tokens / budget
        return max(math.ceil(seqs * mean_len / role_cfg.ppo_max_token_len_per_gpu), floor)
    per_micro = (max(role_cfg.ppo_max_token_len_per_gpu // seq_len, 1) if role_cfg.use_dynamic_bsz
                 else role_cfg.ppo_micro_batch_size_per_gpu)
    return max(math.ceil(seqs / per_micro), floor)


def _roles(cfg) -> dict:
    return {"actor": cfg.actor, **({"critic": cfg.critic} if cfg.use_critic else {})}


def bubble_lines(rep: dict) -> list[str]:
    """The bubble of ``bubble_report`` (or a memory plan) as text, a WARNING line above 25 %."""
    lines = []
    if "pipeline_bubble" in rep:
        lines.append("pipeline bubble (1F1B, one mini-batch): " + ", ".join(
            f"{role} {f:.0%}" for role, f in rep["pipeline_bubble"].items()))
    if "bubble_warning" in rep:
        lines.append(f"WARNING: pipeline bubble above 25 %: {rep['bubble_warning']}; raise "
                     "ppo_mini_batch_size or lower the token budget / pp")
    return lines


def padding_line(cfg, dp: int) -> str:
    """What the training forwards pad (``model.pack_sequences``) and, packed, how many packs a
    mini-batch makes when the mean sequence is half the longest."""
    seq = cfg.data.max_prompt_length + cfg.rollout.response_length
    if not cfg.model.pack_sequences:
        return ("padding: model.pack_sequences=false: each micro-batch is padded to its longest "
                "row (at a mean length half the maximum, about half the computed tokens)")
    tail = (f"; sequence-parallel tail pad < {cfg.parallel.tp} tokens per pack"
            if cfg.model.sequence_parallel and cfg.parallel.tp > 1 else "")
    half = {r: micro_batches_per_pipeline(c, cfg.rollout.n, dp, seq, mean_len=seq / 2,
                                          pp=cfg.parallel.pp) for r, c in _roles(cfg).items()}
    bubble = bubble_report(cfg.parallel.pp, half)["pipeline_bubble"]
    return (f"padding: none (model.pack_sequences: packs of whole sequences, budgets count real "
            f"tokens{tail}); at a mean length half the maximum a mini-batch makes "
            + ", ".join(f"{r} {m} packs per pipeline (bubble {bubble[r]:.0%})"
                        for r, m in half.items()))


def pipeline_lines(cfg, dp: int) -> list[str]:
    """The start-up lines of a run: micro-batches per pipeline of one mini-batch (full-length
    sequences), the 1F1B bubble (``bubble_lines``), the padding (``padding_line``)."""
    seq = cfg.data.max_prompt_length + cfg.rollout.response_length
    full = {r: micro_batches_per_pipeline(c, cfg.rollout.n, dp, seq, pp=cfg.parallel.pp)
            for r, c in _roles(cfg).items()}
    head = ("micro-batches per pipeline per mini-batch (full-length sequences): "
            + ", ".join(f"{r} {m}" for r, m in full.items()) + f" (pp {cfg.parallel.pp})")
    return [head, *bubble_lines(bubble_report(cfg.parallel.pp, full)), padding_line(cfg, dp)]


def _mem_fraction_static(rollout) -> float:
    kwargs = getattr(rollout, "engine_kwargs", None) or {}
    if "mem_fraction_static" in kwargs:
        return float(kwargs["mem_fraction_static"])
    return float(getattr(rollout, "mem_fraction_static", 0.5))


def job_from_config(cfg, shape: LlamaShape, world: int, gpu_gb: float, **overrides) -> MemoryJob:
    """The ``MemoryJob`` of a hybridrl config on ``world`` GPUs (see the module docstring)."""
    a, c, r, par = cfg.actor, cfg.critic, cfg.ref, cfg.parallel
    seq = cfg.data.max_prompt_length + cfg.rollout.response_length

    def budget(role) -> int:
        return role.ppo_max_token_len_per_gpu if role.use_dynamic_bsz else \
            role.ppo_micro_batch_size_per_gpu * seq

    forward = r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else \
        r.log_prob_micro_batch_size_per_gpu * seq
    dp = world // (par.tp * par.pp)
    n = cfg.rollout.n
    fields = dict(
        shape=shape, world=world, tp=par.tp, pp=par.pp, gen_tp=par.gen.tp, gen_pp=par.gen.pp,
        dtype=cfg.model.dtype, max_tokens_per_gpu=budget(a), critic_tokens_per_gpu=budget(c),
        seq_len=min(seq, budget(a)), recompute=cfg.model.recompute_granularity,
        sequence_parallel=cfg.model.sequence_parallel, critic=cfg.use_critic,
        ref=a.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        dist_opt=a.use_distributed_optimizer, offload=frozenset(a.offload_parts),
        rollout_seqs=cfg.data.train_batch_size * n, gpu_gb=gpu_gb,
        engine=cfg.rollout.engine, gen_grouping=cfg.parallel.gen.grouping,
        mem_fraction_static=_mem_fraction_static(cfg.rollout),
        kl_guard=cfg.trainer.kl_guard.max_kl > 0, forward_tokens_per_gpu=max(forward, seq),
        micro_batches=micro_batches_per_pipeline(a, n, dp, seq, pp=par.pp),
        critic_micro_batches=(micro_batches_per_pipeline(c, n, dp, seq, pp=par.pp)
                              if cfg.use_critic else 0),
        ep=getattr(par, "ep", 1), etp=getattr(par, "etp", 0))
    return MemoryJob(**{**fields, **overrides})


def moe_line(moe: dict) -> str:
    """The expert layout and one MoE layer's activation parts of a micro-batch, in GB."""
    return (f"experts: ep {moe['ep']} x etp {moe['etp']}, optimizer state over edp "
            f"{moe['edp']}; one MoE layer per micro-batch: router logits "
            f"{moe['router_logits'] / GB:.2f}, dispatcher buffers {moe['moe_dispatch'] / GB:.2f}, "
            f"expert tensors {moe['experts'] / GB:.2f} GB ({MOE_NOTE})")


def format_report(rep: dict, title: str) -> str:
    """The report as a table: one row per phase, parts in GB, then the verdict."""
    lines = [title, f"{'phase':<13} {'total GB':>9}  parts (GB; worst pipeline stage)"]
    for name, parts in rep["phases"].items():
        detail = ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items() if k != "stage" and v)
        lines.append(f"{name:<13} {rep['totals'][name] / GB:>9.2f}  stage {parts['stage']}: "
                     f"{detail}")
    if "moe" in rep:
        lines.append(moe_line(rep["moe"]))
    lines.append(f"gen KV pool {rep['gen_kv_pool_bytes'] / GB:.2f} GB "
                 f"(mem_fraction_static {rep['mem_fraction_static']:g}): "
                 f"{rep['gen_concurrent_seqs']} of {rep['gen_seqs_per_replica']} sequences of "
                 "a replica at once")
    lines += bubble_lines(rep)
    if "padding" in rep:
        lines.append(rep["padding"])
    lines.append(f"KL-guard snapshot: {rep['kl_guard_snapshot_host_bytes'] / GB:.2f} GB of host "
                 "memory per rank per step")
    if "reshard_traffic" in rep:
        t = rep["reshard_traffic"]
        lines.append(f"reshard ({t['strategy']}) per GPU per step: up to "
                     f"{t['inter_node_bytes'] / GB:.2f} GB across nodes + "
                     f"{t['worst_rank_intra_bytes'] / GB:.2f} GB inside its node (rank "
                     f"{t['worst_rank']}; {t['gpus_per_node']} GPUs per node)")
    cap = rep["gpu_bytes"] / GB
    if rep["fits"]:
        lines.append(f"fits in {cap:g} GB: largest phase {rep['largest_phase']} "
                     f"{rep['totals'][rep['largest_phase']] / GB:.2f} GB, headroom "
                     f"{rep['headroom_bytes'] / GB:.2f} GB")
    else:
        o = rep["overflow"]
        lines.append(f"does NOT fit in {cap:g} GB: {o['phase']} overflows by "
                     f"{o['bytes'] / GB:.2f} GB")
    return "\n".join(lines)
