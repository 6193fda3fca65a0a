"""Rank-side bodies of the packed-vs-padded tests (module level for the forkserver ranks).

One case = one layout (tp, pp, optional sequence parallelism; ``loop``: attention by one SDPA
call per sequence instead of the block-diagonal mask these short packs get). On every rank it builds the same
synthetic rollout batch (sequence lengths 1..14, empty responses, a sequence of ONE token), takes
this DP rank's contiguous rows in micro-batches that include a micro-batch of one sequence, and
runs each of actor and critic twice from the same HF checkpoint (``folder``; the critic's
value head seeded): right-padded micro-batches,
then packed ones (``RolloutBatch.microbatch(packed=True)``). Per mode: forward-only log-probs,
entropy and values at the response tokens (what the old / reference / value forwards read),
then one training step each (the trainer's actor and critic losses with global normalizers;
megatron's plain optimizer so every rank holds the whole DP-reduced gradient) giving the loss,
the grad norm, every local ``main_grad`` and the updated parameters. Returns plain numbers:
the largest packed-vs-padded difference of each quantity, and on the last stage's tp rank 0
the masked response outputs of this DP rank (the parent compares layouts with (1,1,1)).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from hybridrl.models import packing

CALL_COST_ELEMENTS = packing.CALL_COST_ELEMENTS  # the library's choice, restored after "loop"

N_SEQS, R = 8, 8
PROMPT_LENS = [1, 3, 6, 2, 5, 1, 4, 6]
RESP_LENS = [0, 8, 2, 5, 1, 7, 3, 8]  # row 0: one token in all; row 4 ends at the budget edge


def make_rollout():
    """The synthetic rollout batch and its per-token tensors (same on every rank)."""
    from hybridrl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in PROMPT_LENS]
    resp = torch.randint(3, 100, (N_SEQS, R), generator=g)
    mask = (torch.arange(R)[None, :] < torch.tensor(RESP_LENS)[:, None]).long()
    resp = resp * mask
    rb = RolloutBatch(prompts, resp, mask, torch.zeros(N_SEQS, R), list(range(N_SEQS)),
                      [None] * N_SEQS, ["x"] * N_SEQS, [{}] * N_SEQS)
    tensors = {k: torch.randn(N_SEQS, R, generator=g) * s for k, s in
               (("advantages", 1.0), ("returns", 1.0), ("values", 0.5))}
    tensors["old_log_probs"] = -torch.rand(N_SEQS, R, generator=g) * 4 - 1
    tensors["ref_log_probs"] = -torch.rand(N_SEQS, R, generator=g) * 4 - 1
    return rb, tensors


def _parts(dp_size: int, dp_rank: int) -> list[list[int]]:
    n = N_SEQS // dp_size
    rows = list(range(dp_rank * n, (dp_rank + 1) * n))
    return [rows[:1], rows[1:3], rows[3:]] if n >= 4 else [rows[:1], rows[1:]]


def _mode(groups, case, rb, tensors, parts, packed: bool) -> dict:
    from hybridrl.algos.agg import compute_agg_normalizers
    from hybridrl.config.model import ModelConfig
    from hybridrl.config.roles import ActorConfig, CriticConfig
    from hybridrl.models.build import DDPOptions
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config
    from hybridrl.models.naming import named_local_parameters
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from hybridrl.rollout.batch import gather_response
    from hybridrl.trainer.updates import actor_loss_fn, critic_loss_fn

    mc = ModelConfig(path=case["folder"], sequence_parallel=case.get("sp", False))
    ddp = DDPOptions(use_distributed_optimizer=False)
    mbs = [rb.microbatch(p, tensors, packed=packed) for p in parts]
    norm = compute_agg_normalizers([mb["response_mask"] for mb in mbs],
                                   groups.dp if groups.dp_size > 1 else None,
                                   loss_scale_factor=R)
    actor_cfg = dataclasses.replace(ActorConfig(), entropy_coeff=0.01, use_kl_loss=True)
    out = {}
    for role, key, loss in (
            ("actor", "logprobs", functools.partial(actor_loss_fn, actor_cfg, False)),
            ("critic", "values", functools.partial(critic_loss_fn, CriticConfig()))):
        model = build_from_config(mc, groups, role, seed=5, ddp_options=ddp)
        res = run_microbatches(model, mbs, with_entropy=True)
        for name in ((key, "entropy") if role == "actor" else (key,)):
            if res:
                out[name] = torch.cat([gather_response(o[name], mb["resp_index"]).cpu()
                                       * mb["response_mask"] for o, mb in zip(res, mbs)])
        opt = ModelOptimizer(model, OptimConfig(lr=1e-3, grad_clip=0.0))
        metrics = train_step(model, opt, mbs, functools.partial(loss, norm=norm, k=len(mbs)))
        out[f"{role}_loss"] = torch.tensor(metrics["loss"])
        out[f"{role}_grad_norm"] = torch.tensor(metrics["grad_norm"])
        params = dict(named_local_parameters(model))
        out[f"{role}_grads"] = torch.cat([p.main_grad.flatten() for p in params.values()]).cpu()
        out[f"{role}_params"] = torch.cat([p.detach().flatten().float()
                                           for p in params.values()]).cpu()
    return out


def packed_vs_padded(groups, case: dict) -> dict:
    packing.CALL_COST_ELEMENTS = 0 if case.get("loop") else CALL_COST_ELEMENTS  # 0: SDPA per seq
    rb, tensors = make_rollout()
    parts = _parts(groups.dp_size, groups.dp_rank)
    padded = _mode(groups, case, rb, tensors, parts, packed=False)
    packed = _mode(groups, case, rb, tensors, parts, packed=True)
    diffs = {k: float((padded[k] - packed[k]).abs().max()) for k in padded}
    scale = {k: float(padded[k].abs().max()) for k in padded}
    out = {"diffs": diffs, "scale": scale, "dp_rank": groups.dp_rank}
    if groups.is_last_stage and groups.tp_rank == 0:
        out.update({k: packed[k].numpy() for k in ("logprobs", "entropy", "values")})
        out.update({f"padded_{k}": padded[k].numpy() for k in ("logprobs", "values")})
    return out


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case in order on this rank (all ranks run the same list)."""
    import warnings

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    warnings.filterwarnings("ignore")
    results, groups_by_layout = [], {}
    for case in cases:
        key = (case["tp"], case["pp"])
        if key not in groups_by_layout:
            groups_by_layout[key] = build_groups(TrainLayout(world=world, tp=key[0], pp=key[1]))
        torch.manual_seed(0)
        results.append(packed_vs_padded(groups_by_layout[key], case))
    return [{k: (np.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in r.items()}
            for r in results]
