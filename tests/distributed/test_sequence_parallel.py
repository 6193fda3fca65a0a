"""``model.sequence_parallel`` on CPU gloo ranks gives the numbers of the run without it.

One 4-rank launch. At tp 2 (2, 1, 2) and (2, 2, 1), with and without sequence parallelism, from
the same seed: the actor's log-prob forward, the actor's and critic's training pass (losses and
the fp32 main grads after megatron's finalize_model_grads, which all-reduces the norms' grads over
TP), the SFT loss on ``sft_microbatch`` rows, all with an odd sequence length (the micro-batches
are padded to a multiple of tp); and a 2-step PPO run at (2, 2, 1) (metrics). Everything within
1e-5 (measured: see the printed maxima).
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

SIZES = dict(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             num_layers=2, vocab_size=256)
LAYOUTS = {"tp2_dp2": (2, 1), "tp2_pp2": (2, 2)}
TOL = 1e-5


def _model_cases(groups, sp: bool) -> dict:
    from megatron.core.distributed import finalize_model_grads

    from hybridrl.config.model import ModelConfig
    from hybridrl.data.sft import SFTExample, sft_microbatch
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config
    from hybridrl.trainer.sft import sft_loss

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 11), generator=gen)  # T = 11: padded to 12 under SP
    out = {}
    actor = build_from_config(ModelConfig(sequence_parallel=sp, **SIZES), groups, "actor", seed=3)
    norms = [p for n, p in actor.module.named_parameters() if "layernorm" in n]
    assert norms and all(getattr(p, "sequence_parallel", False) == sp for p in norms)
    res = run_microbatches(actor, [{"input_ids": ids}])
    out["logprobs"] = [r["logprobs"][:, :11] for r in res]

    def train(model, loss_fn, batches):
        model.ddp.zero_grad_buffer()
        res = run_microbatches(model, batches, loss_fn, forward_only=False)
        finalize_model_grads([model.ddp], pg_collection=model.pg_collection)
        return {"losses": [float(r["loss"]) for r in res],
                "grads": [p.main_grad.clone() for p in model.module.parameters()]}

    out["actor"] = train(actor, lambda o, b: (-o["logprobs"][:, :11].mean()
                                              - 0.01 * o["entropy"][:, :11].mean(), {}),
                         [{"input_ids": ids}, {"input_ids": ids.flip(0)}])
    critic = build_from_config(ModelConfig(sequence_parallel=sp, **SIZES), groups, "critic",
                               seed=3)
    out["critic"] = train(critic, lambda o, b: (((o["values"][:, :11] - 0.5) ** 2).mean(), {}),
                          [{"input_ids": ids}])
    examples = [SFTExample(0, [5, 6, 7], [8, 9, 10, 11]), SFTExample(1, [12, 13], [14, 15])]
    mb = sft_microbatch(examples, pad_id=0)  # T = 7
    n_tokens = float(mb["loss_mask"].sum())
    sft = build_from_config(ModelConfig(sequence_parallel=sp, **SIZES), groups, "actor", seed=3)
    out["sft"] = train(sft, lambda o, b: sft_loss(o, b, n_tokens=n_tokens, scale=1.0), [mb])
    return out


def _ppo(rank, world, root, sp: bool) -> list[dict]:
    from tests.distributed.test_trainer_cases import _clean, _trainer, base_overrides, run_in

    overrides = [*base_overrides(root), *run_in(f"{root}/ppo_sp{int(sp)}"), "parallel.tp=2",
                 "parallel.pp=2", f"model.sequence_parallel={str(sp).lower()}",
                 "algorithm.adv_estimator=gae", "actor.use_kl_loss=true"]
    trainer, _ = _trainer(rank, world, overrides)
    assert trainer.actor.config.sequence_parallel == sp and trainer.critic.config.sequence_parallel == sp
    return _clean(trainer.fit())


def rank_main(rank: int, world: int, root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        groups = build_groups(TrainLayout(world=world, tp=tp, pp=pp))
        out[name] = {sp: _model_cases(groups, sp) for sp in (False, True)}
    out["ppo"] = {sp: _ppo(rank, world, root, sp) for sp in (False, True)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sp"))
    return run_on_ranks(rank_main, 4, root, timeout=900, preload=("megatron.core",))


def _max_diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max([_max_diff(x, y) for x, y in zip(a, b)], default=0.0)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max([_max_diff(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
        return 0.0
    return abs(float(a) - float(b))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", ["logprobs", "actor", "critic", "sft"])
def test_sequence_parallel_equals_the_run_without_it(results, layout, case):
    worst = max(_max_diff(r[layout][False][case], r[layout][True][case]) for r in results)
    print(f"{layout} {case}: max |SP - no SP| = {worst:.3g}")
    assert worst <= TOL
    if case == "logprobs":  # the last stage returned them
        assert any(r[layout][True][case] for r in results)


@pytest.mark.slow
def test_ppo_loop_with_sequence_parallel_equals_the_run_without_it(results):
    worst = max(_max_diff(r["ppo"][False], r["ppo"][True]) for r in results)
    print(f"PPO (2, 2, 1), 2 steps: max |SP - no SP| over metrics = {worst:.3g}")
    assert len(results[0]["ppo"][True]) == 2 and worst <= TOL
