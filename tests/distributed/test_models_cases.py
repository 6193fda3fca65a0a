"""Rank-side bodies of the model tests (module-level so the forkserver ranks can import them).

Every function returns plain numpy/python values (tensors do not survive the result queue).
A "case" is a dict: tp, pp, folder (HF checkpoint), and what to run (see ``run_cases``).
"""

from __future__ import annotations

import numpy as np
import torch

LR, WEIGHT_DECAY, GRAD_CLIP = 1e-3, 0.01, 0.05
ENTROPY_COEF = 0.01


def make_batch(seed: int, n_seqs: int, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
    """The global batch every layout sees: token ids, per-token advantages and returns."""
    g = np.random.default_rng(seed)
    return {
        "input_ids": g.integers(0, vocab, size=(n_seqs, seq_len)),
        "advantages": g.standard_normal((n_seqs, seq_len)).astype(np.float32),
        "returns": g.standard_normal((n_seqs, seq_len)).astype(np.float32),
    }


def split_microbatches(batch: dict, dp_size: int, dp_rank: int, n_micro: int) -> list[dict]:
    """This DP rank's contiguous share of the batch, cut into ``n_micro`` micro-batches."""
    n = len(batch["input_ids"]) // dp_size
    mine = {k: torch.as_tensor(v[dp_rank * n:(dp_rank + 1) * n]) for k, v in batch.items()}
    size = n // n_micro
    return [{k: v[i * size:(i + 1) * size] for k, v in mine.items()} for i in range(n_micro)]


def actor_loss(outputs: dict, batch: dict):
    """A PPO-shaped objective: -adv * logp (token mean) minus an entropy bonus."""
    logp, entropy = outputs["logprobs"][:, :-1], outputs["entropy"][:, :-1]
    adv = batch["advantages"][:, :-1].to(logp.device)
    pg = -(adv * logp).mean()
    ent = entropy.mean()
    loss = pg - ENTROPY_COEF * ent
    return loss, {"pg": pg.detach(), "entropy": ent.detach()}


def critic_loss(outputs: dict, batch: dict):
    values = outputs["values"]
    loss = 0.5 * ((values - batch["returns"].to(values.device)) ** 2).mean()
    return loss, {"vf": loss.detach()}


def _groups(world: int, tp: int, pp: int):
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    return build_groups(TrainLayout(world=world, tp=tp, pp=pp))


def _logprob_case(groups, case: dict) -> dict:
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_hf
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig

    role = case.get("role", "actor")
    model = build_from_hf(case["folder"], groups, role)
    if role == "reference":  # frozen: no trainable parameter, no DDP, no optimizer
        assert model.ddp is None and not any(p.requires_grad for p in model.module.parameters())
        try:
            ModelOptimizer(model, OptimConfig())
        except ValueError:
            pass
        else:
            raise AssertionError("a reference model must refuse an optimizer")
    mbs = split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    out = run_microbatches(model, mbs)
    if not groups.is_last_stage or groups.tp_rank != 0:
        return {}
    return {
        "dp_rank": groups.dp_rank,
        "logprobs": np.concatenate([o["logprobs"].numpy() for o in out]),
        "entropy": np.concatenate([o["entropy"].numpy() for o in out]),
    }


def _train_case(groups, case: dict) -> dict:
    """One optimizer step, exported; then the save/load round trip: a second step taken twice,
    once straight on and once after restoring the state saved after the first step, must agree
    bit for bit (the restore also rebuilds the parameters from the optimizer's main shards)."""
    from hybridrl.models.build import DDPOptions
    from hybridrl.models.hf_io import build_from_hf, export_hf
    from hybridrl.models.naming import named_local_parameters
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step

    role = case.get("role", "actor")
    overlap = case.get("overlap", False)
    options = DDPOptions(use_distributed_optimizer=case.get("distributed", True),
                         overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                         bucket_size=4096 if overlap else None)  # several buckets in flight
    model = build_from_hf(case["folder"], groups, role, dtype=case.get("dtype", "fp32"),
                          ddp_options=options)
    cfg = OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP)
    opt = ModelOptimizer(model, cfg)
    mbs = split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    loss_fn = critic_loss if role == "critic" else actor_loss
    metrics = train_step(model, opt, mbs, loss_fn)
    opt.gather_params()
    zero_grads = [n for n, p in named_local_parameters(model)
                  if p.requires_grad and not bool(p.main_grad.abs().sum() > 0)]
    export_hf(model, case["out"])
    saved = opt.state_dict()
    main_numel = sum(p.numel() for p in opt.main_params())
    state_bytes = opt.state_bytes()
    stage_numel = sum(p.numel() for p in model.module.parameters())
    train_step(model, opt, mbs, loss_fn)
    opt.gather_params()  # overlap_param_gather defers it to the next forward
    straight = [p.detach().clone() for _, p in named_local_parameters(model)]
    restored = ModelOptimizer(model, cfg)
    restored.load_state_dict(saved)
    train_step(model, restored, mbs, loss_fn)
    restored.gather_params()
    again = [p.detach().clone() for _, p in named_local_parameters(model)]
    return {"metrics": metrics, "zero_grads": zero_grads, "vocab_start": model.vocab_start,
            "tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "dp_rank": groups.dp_rank,
            "main_numel": main_numel, "stage_numel": stage_numel, "state_bytes": state_bytes,
            "resume_exact": all(torch.equal(a, b) for a, b in zip(straight, again)),
            "step_count": restored.step_count}


def _critic_values_case(groups, case: dict) -> dict:
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_hf
    from hybridrl.models.naming import named_local_parameters

    model = build_from_hf(case["folder"], groups, "critic")
    mbs = split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    out = run_microbatches(model, mbs)
    if not groups.is_last_stage or groups.tp_rank != 0:
        return {}
    head = dict(named_local_parameters(model))["output_layer.weight"]
    return {"dp_rank": groups.dp_rank, "head": head.detach().numpy(),
            "values": np.concatenate([o["values"].numpy() for o in out])}


def _roundtrip_case(groups, case: dict) -> dict:
    from hybridrl.models.hf_io import build_from_hf, export_hf
    from hybridrl.models.naming import named_local_parameters

    model = build_from_hf(case["folder"], groups, case.get("role", "actor"))
    export_hf(model, case["out"])
    again = build_from_hf(case["out"], groups, case.get("role", "actor"))
    a, b = named_local_parameters(model), named_local_parameters(again)
    same = [n1 == n2 and torch.equal(p1, p2) for (n1, p1), (n2, p2) in zip(a, b)]
    return {"exact": len(a) == len(b) and all(same), "n_params": len(a)}


def _builtin_case(groups, case: dict) -> dict:
    """No HF folder: actor, reference and critic trunk start from the same seeded weights."""
    from hybridrl.config.model import ModelConfig
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config

    mc = ModelConfig()
    batch = make_batch(1, 4, 10, mc.vocab_size)
    mbs = split_microbatches(batch, groups.dp_size, groups.dp_rank, 2)
    out = {}
    from hybridrl.parallel.megatron import clear_megatron_groups

    for role in ("actor", "reference", "critic"):
        model = build_from_config(mc, groups, role, seed=7)
        clear_megatron_groups()  # e.g. another layout was installed meanwhile: forward re-installs
        res = run_microbatches(model, mbs)
        key = "values" if role == "critic" else "logprobs"
        out[role] = np.concatenate([r[key].numpy() for r in res]) if res else None
    return out


def _load_error_case(groups, case: dict) -> dict:
    """Loading must fail with a ValueError (not load something else silently)."""
    from hybridrl.models.hf_io import build_from_hf

    try:
        build_from_hf(case["folder"], groups, "actor")
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


def _nonfinite_case(groups, case: dict) -> dict:
    """A NaN loss on ONE rank (dp_rank 1, tp_rank 0, last stage): every rank skips the update,
    the weights, the optimizer state and the step count stay as they were."""
    from hybridrl.models.hf_io import build_from_hf
    from hybridrl.models.naming import named_local_parameters
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step

    model = build_from_hf(case["folder"], groups, "actor")
    opt = ModelOptimizer(model, OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP))
    mbs = split_microbatches(case["batch"], groups.dp_size, groups.dp_rank, case["n_micro"])
    train_step(model, opt, mbs, actor_loss)
    before = [p.detach().clone() for _, p in named_local_parameters(model)]
    state = opt.state_dict()
    poison = groups.dp_rank == 1 and groups.tp_rank == 0

    def nan_loss(outputs, batch):
        loss, metrics = actor_loss(outputs, batch)
        return (loss * float("nan") if poison else loss), metrics

    metrics = train_step(model, opt, mbs, nan_loss)
    after = [p.detach().clone() for _, p in named_local_parameters(model)]
    same_state = all(torch.equal(a, b) for a, b in zip(state["main_params"],
                                                        opt.state_dict()["main_params"]))
    metrics_ok = train_step(model, opt, mbs, actor_loss)  # and training goes on
    return {"skipped": metrics["skipped"], "grad_norm": metrics["grad_norm"],
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)) and same_state,
            "step_count": opt.step_count, "next_skipped": metrics_ok["skipped"]}


CASE_KINDS = {
    "nonfinite": _nonfinite_case,
    "load_error": _load_error_case,
    "builtin": _builtin_case,
    "logprobs": _logprob_case,
    "train": _train_case,
    "critic_values": _critic_values_case,
    "roundtrip": _roundtrip_case,
}


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Run every case in order on this rank (all ranks run the same list)."""
    import warnings

    warnings.filterwarnings("ignore")
    groups_by_layout = {}
    results = []
    for case in cases:
        key = (case["tp"], case["pp"])
        if key not in groups_by_layout:
            groups_by_layout[key] = _groups(world, *key)
        torch.manual_seed(0)
        results.append(CASE_KINDS[case["kind"]](groups_by_layout[key], case))
    return results
