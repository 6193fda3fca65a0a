"""Rank-side bodies of the trainer tests (module level so forkserver ranks can import them).

A case is (name, overrides, action); every rank builds the config from ``base_overrides`` plus
the case's, builds its groups and a ``PPOTrainer`` and runs ``action``. Results are plain
python values: per-step metric dicts without the timing/perf keys (they are not reproducible).
"""

from __future__ import annotations

import math
import os

import torch


def run_in(folder: str) -> list[str]:
    """Overrides that make ``folder`` the run folder (``trainer.output_dir`` = its parent,
    ``trainer.experiment_name`` = its name); checkpoints go to ``folder/checkpoints``."""
    parent, name = os.path.split(folder.rstrip("/"))
    return [f"trainer.output_dir={parent}", f"trainer.experiment_name={name}"]


def base_overrides(root: str) -> list[str]:
    """A tiny run: 2-layer llama, 1-digit additions, 4 prompts x 2 samples, 2 mini-batches."""
    return [
        "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.vocab_size=100",
        "model.max_position_embeddings=96",
        "data.max_prompt_length=80", "data.train_batch_size=4", "data.val_batch_size=8",
        "data.synthetic.max_digits=1", "data.synthetic.train_size=32",
        "data.synthetic.val_size=8", f"data.synthetic.dir={root}/data",
        "rollout.n=2", "rollout.response_length=6",
        "actor.lr=1e-3", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
        "critic.lr=1e-3", "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=2",
        "ref.log_prob_micro_batch_size_per_gpu=2",
        "trainer.total_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.logger=[console,jsonl]", "trainer.device=cpu", "reshard.bucket_mb=1",
        "reward.format_score=0.1",
    ]


def _clean(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items()
             if not k.startswith(("timing_s/", "perf/", "reshard/", "rollout/handoff"))}
            for m in history]


def _trainer(rank: int, world: int, overrides: list[str]):
    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer

    cfg = load_config([], overrides)
    cfg.check_world(world)
    train, gen = build_layout(cfg, world)
    torch.manual_seed(cfg.trainer.seed)
    lines = []
    trainer = PPOTrainer(cfg, build_groups(train, gen),
                         print_fn=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return trainer, lines


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.actor.module.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _equal_state(a, b) -> bool:
    """Deep equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    return a == b


def _guard(rank, world, overrides):
    """One guarded step: actor and critic parameters, both optimizers' state and the KL
    controller after it equal those before."""
    from hybridrl.checkpoint.folder import capture_state

    trainer, lines = _trainer(rank, world, overrides)
    before = _params(trainer)
    state_before = capture_state(trainer._models(), trainer.kl_ctrl)
    optim_before = trainer.actor_opt.step_count
    m = trainer.train_step()
    after = _params(trainer)
    state_after = capture_state(trainer._models(), trainer.kl_ctrl)
    return {"rollback": m["training/kl_guard_rollback"],
            "same": _same(before, after) and _equal_state(state_before, state_after),
            "n_models": len(state_before["optim"]),
            "kl_final": m["actor/ppo_kl_final"],
            "optim_steps": (optim_before, trainer.actor_opt.step_count),
            "logged": any("rolled back" in line for line in lines)}


def _error(rank, world, overrides):
    """Run to the end; return the RuntimeError's message (or None)."""
    trainer, _ = _trainer(rank, world, overrides)
    try:
        trainer.fit()
    except RuntimeError as err:
        return str(err)
    return None


def _fit(rank, world, overrides):
    trainer, lines = _trainer(rank, world, overrides)
    before = _params(trainer)
    history = trainer.fit()
    return {"metrics": _clean(history), "changed": not _same(before, _params(trainer)),
            "lines": lines, "finite": all(math.isfinite(v) for m in history for v in m.values()),
            "reshard": [{k: v for k, v in m.items() if k.startswith("reshard/")} for m in history],
            "transfers": sum(len(s) + len(r) for s, r in
                             trainer.worker.plan.rank_buckets(trainer.worker.rank))}


def _reward_model(rank, world, overrides):
    """One rollout scored by the reward model: the scores and the sequences they score. Row i's
    response is cut to i % (R + 1) tokens (row 0 empty), so every row ends somewhere else."""
    trainer, _ = _trainer(rank, world, overrides)
    trainer.worker.sync_weights(trainer.actor)
    rb = trainer._rollout(trainer.loader.next_batch())
    R = rb.response_mask.shape[1]
    for i in range(len(rb)):
        rb.response_mask[i, i % (R + 1):] = 0
    scores, metrics = trainer._reward_model_scores(rb, rb.response_mask)
    seqs = [p + r[m.bool()].tolist()
            for p, r, m in zip(rb.prompt_ids, rb.response_ids, rb.response_mask)]
    return {"scores": scores, "seqs": seqs, "metrics": metrics,
            "lengths": rb.response_mask.sum(1).tolist()}


def _offload(rank, world, overrides):
    """Run to the end with offload flags set, recording which model bytes sit on the device
    while the engine generates and while each model updates (measured from the storages)."""
    trainer, _ = _trainer(rank, world, overrides)
    trainer.memory.enter("all")  # the engine started with everything away: all back, measured
    full, seen = trainer.memory.resident_bytes(), {}
    generate, update = trainer.worker.generate_partitioned, trainer._update

    def spy_generate(*args, **kwargs):  # the last step's view is kept (optimizer state exists)
        seen["gen"] = trainer.memory.resident_bytes()
        return generate(*args, **kwargs)

    def spy_update(model, *args, **kwargs):
        seen[f"update_{model.role}"] = trainer.memory.resident_bytes()
        return update(model, *args, **kwargs)

    trainer.worker.generate_partitioned, trainer._update = spy_generate, spy_update
    history = trainer.fit()
    optim = {"actor": trainer.actor_opt.state_bytes(), "critic": trainer.critic_opt.state_bytes()}
    return {"metrics": _clean(history), "full": full, "seen": seen, "optim": optim}


ACTIONS = {"fit": _fit, "offload": _offload, "guard": _guard, "error": _error, "rm": _reward_model}


def run_cases(rank: int, world: int, root: str, cases: list) -> dict:
    """Every case in order on this rank: {name: result}."""
    out = {}
    for name, overrides, action in cases:
        out[name] = ACTIONS[action](rank, world, base_overrides(root) + overrides)
    return out
