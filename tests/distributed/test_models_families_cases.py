"""Rank-side bodies of test_models_families.py (module level, so forkserver ranks import them).

Adds to test_models_cases' kinds:
- ``engine``: the actor resharded into the builtin engine (RolloutWorker, gen tp 2): the
  engine's prefill log-probs of the batch, and sampled responses with their log-probs;
- ``checkpoint``: the actor (and its optimizer) saved by the trainer's ``Checkpointer`` into
  ``case["out"]`` (what ``hybridrl export`` reads), with a stand-in trainer of the fields it
  reads.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.distributed import test_models_cases as base


def _engine_case(groups, case: dict) -> dict:
    from types import SimpleNamespace

    import torch.nn.functional as F

    from hybridrl.config.loader import load_config
    from hybridrl.models.hf_io import build_from_hf
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.worker import RolloutWorker

    cfg = load_config(overrides=[
        "rollout.engine=builtin", f"model.path={case['folder']}", f"parallel.tp={groups.tp_size}",
        f"parallel.pp={groups.pp_size}", f"parallel.gen.tp={case['gen_tp']}"])
    actor = build_from_hf(case["folder"], groups, "actor")
    worker = RolloutWorker(cfg, groups, actor, SimpleNamespace(pad_token_id=0, eos_token_id=None))
    worker.sync_weights(actor)
    engine = worker.engine
    ids = torch.as_tensor(case["batch"]["input_ids"])  # [B, T]
    B, T = ids.shape
    with torch.inference_mode():
        pos = torch.arange(T).expand(B, T)
        allowed = torch.ones(B, T, T, dtype=torch.bool).tril()
        h = engine.forward(ids, pos, engine._new_cache(B, T), 0, allowed)  # [B, T, H]
        logits = engine.logits(h.reshape(B * T, -1)).view(B, T, -1)
        logp = F.log_softmax(logits.float(), dim=-1)[:, :-1].gather(
            -1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    prompts = [list(map(int, row[:5])) for row in case["batch"]["input_ids"][:4]]
    out = worker.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                  pad_token_id=0), seed=3)
    if groups.rank != 0:
        return {}
    return {"engine_logprobs": logp.numpy(), "prompts": prompts,
            "responses": out.response_ids.numpy(), "response_mask": out.response_mask.numpy(),
            "response_logprobs": out.logprobs.numpy()}


def _checkpoint_case(groups, case: dict) -> dict:
    from types import SimpleNamespace

    import torch.distributed as dist

    from hybridrl.checkpoint.checkpointer import Checkpointer
    from hybridrl.models.hf_io import build_from_hf
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig

    actor = build_from_hf(case["folder"], groups, "actor")
    state = SimpleNamespace(state_dict=dict)
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(trainer=SimpleNamespace(resolved_checkpoint_dir=case["out"],
                                                    async_save=False, max_ckpt_to_keep=0),
                            model=SimpleNamespace(tokenizer_path="", path=case["folder"])),
        actor=actor, actor_opt=ModelOptimizer(actor, OptimConfig()), critic=None,
        critic_opt=None, groups=groups, world=dist.get_world_size(), rank=dist.get_rank(),
        memory=SimpleNamespace(enter=lambda phase: None), step=1, guard=state, kl_ctrl=state,
        loader=state, run_id="families", log=SimpleNamespace(line=print))
    return {"folder": str(Checkpointer(trainer).save())}


CASE_KINDS = {**base.CASE_KINDS, "engine": _engine_case, "checkpoint": _checkpoint_case}


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case in order on this rank (all ranks run the same list)."""
    import warnings

    warnings.filterwarnings("ignore")
    groups_by_layout, results = {}, []
    for case in cases:
        key = (case["tp"], case["pp"])
        if key not in groups_by_layout:
            groups_by_layout[key] = base._groups(world, *key)
        torch.manual_seed(0)
        results.append(CASE_KINDS[case["kind"]](groups_by_layout[key], case))
    return [{k: (np.asarray(v) if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
            for r in results]
