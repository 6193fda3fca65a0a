"""Rank-side bodies of test_moe_train.py (module level, so forkserver ranks import them).

A case is a dict: tp, pp, ep (expert tp = tp), folder (an HF Qwen3-MoE checkpoint), kind:
- ``logprobs``: the actor's per-token log-probs (last stage, tp_rank 0, with its dp_rank);
- ``train``: one optimizer step (the PPO-shaped loss of test_models_cases), exported to
  ``case["out"]`` with ``export_hf``; returns the step's metrics;
- ``builtin``: the builtin MoE of ``case["model"]`` (ModelConfig overrides, e.g. the model
  section of configs/demo_moe.yaml), no HF folder: its log-probs, then one step, exported.
MoE layers at tp > 1 run with sequence parallelism (megatron's requirement for training).
"""

from __future__ import annotations

import numpy as np
import torch

from tests.distributed import test_models_cases as base


def _groups(world: int, tp: int, pp: int, ep: int):
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    return build_groups(TrainLayout(world=world, tp=tp, pp=pp, ep=ep))


def _build(groups, case: dict):
    from hybridrl.models.hf_io import build_from_hf

    extra = {"sequence_parallel": True} if groups.tp_size > 1 else {}
    return build_from_hf(case["folder"], groups, "actor", **extra)


def _logprob_case(groups, case: dict) -> dict:
    from hybridrl.models.forward import run_microbatches

    model = _build(groups, case)
    mbs = base.split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    out = run_microbatches(model, mbs)
    if not groups.is_last_stage or groups.tp_rank != 0:
        return {}
    return {"dp_rank": groups.dp_rank,
            "logprobs": np.concatenate([o["logprobs"].numpy() for o in out])}


def _train_case(groups, case: dict) -> dict:
    from hybridrl.models.hf_io import export_hf
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step

    model = _build(groups, case)
    opt = ModelOptimizer(model, OptimConfig(lr=base.LR, weight_decay=base.WEIGHT_DECAY,
                                            grad_clip=base.GRAD_CLIP))
    mbs = base.split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    metrics = train_step(model, opt, mbs, base.actor_loss)
    opt.gather_params()
    export_hf(model, case["out"])
    return {"metrics": metrics, "pp_rank": groups.pp_rank, "state_bytes": opt.state_bytes(),
            "numel": sum(p.numel() for p in model.module.parameters())}


def _builtin_case(groups, case: dict) -> dict:
    from hybridrl.config.loader import load_config
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config, export_hf
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step

    cfg = load_config(case["config"])
    model = build_from_config(cfg.model, groups, "actor", seed=5)
    mbs = base.split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    out = run_microbatches(model, mbs)
    export_hf(model, case["out"])  # the initial weights, for transformers
    metrics = train_step(model, ModelOptimizer(model, OptimConfig(lr=base.LR)), mbs,
                         base.actor_loss)
    if not groups.is_last_stage or groups.tp_rank != 0:
        return {}
    return {"dp_rank": groups.dp_rank, "metrics": metrics,
            "logprobs": np.concatenate([o["logprobs"].numpy() for o in out])}


def _groups_case(groups, case: dict) -> dict:
    """megatron's own view of the expert groups once hybridrl installed them, and an
    all_reduce of the rank over each expert group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.megatron import apply_megatron_groups

    apply_megatron_groups(groups)
    sums = {}
    for name in ("ep", "expt_tp", "expt_dp", "tp_ep"):
        t = torch.tensor([float(groups.rank)])
        dist.all_reduce(t, group=groups.groups[name])
        sums[name] = (t.item(), float(sum(groups.members[name])))
    return {"rank": groups.rank, "sums": sums,
            "megatron": (ps.get_expert_model_parallel_rank(),
                         ps.get_expert_tensor_parallel_rank(),
                         ps.get_expert_data_parallel_rank(),
                         list(ps.get_expert_model_parallel_group().size() for _ in (0,))),
            "members": {n: list(groups.members[n]) for n in ("ep", "expt_tp", "expt_dp")}}


CASE_KINDS = {"groups": _groups_case, "logprobs": _logprob_case, "train": _train_case, "builtin": _builtin_case}


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Run every case in order on this rank (all ranks run the same list)."""
    import warnings

    warnings.filterwarnings("ignore")
    groups_by_layout = {}
    results = []
    for case in cases:
        key = (case["tp"], case["pp"], case["ep"])
        if key not in groups_by_layout:
            groups_by_layout[key] = _groups(world, *key)
        torch.manual_seed(0)
        results.append(CASE_KINDS[case["kind"]](groups_by_layout[key], case))
    return results
