"""Fused weight-gradient accumulation (``hybridrl.models.wgrad``) on 2 gloo ranks.

hybridrl's actor with its lean linears routed through ``wgrad.linear`` against the same model
through ``F.linear`` (``tests/unit/test_wgrad.py``'s helpers), two optimizer steps of two
micro-batches each: at tp 2 (each rank accumulates its weight shard; the column linear's input
gradient is all-reduced) and at dp 2 with megatron's bucketed ``overlap_grad_reduce`` and
``overlap_param_gather`` (the backward hook's ``register_grad_ready`` needs the dummy weight
gradient; small buckets, several in flight). ``main_grad`` after each step and the final
parameters equal the unfused run's (1e-6 relative), and the fused path ran on every lean linear.
"""

from __future__ import annotations

import pytest

from hybridrl.testing.dist import run_on_ranks

RTOL = 1e-6


def _rank(rank, world):
    import warnings

    from hybridrl.models.build import DDPOptions
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from tests.unit.test_wgrad import compare

    warnings.filterwarnings("ignore")
    out = {}
    tp2 = build_groups(TrainLayout(world=2, tp=2, pp=1))
    out["tp2"] = compare(tp2, tied=False)
    dp2 = build_groups(TrainLayout(world=2, tp=1, pp=1))
    out["dp2_overlap"] = compare(dp2, tied=True, ddp_options=DDPOptions(
        overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=4096))
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_rank, 2, timeout=300, preload=("megatron.core",))


@pytest.mark.parametrize("case", ["tp2", "dp2_overlap"])
def test_fused_equals_unfused_on_two_ranks(results, case):
    for rank_res in results:
        res = rank_res[case]
        assert res["n_lean"] == 9
        fused_flags, base_flags = res["flags"]
        assert all(all(step) for step in fused_flags), fused_flags
        assert not any(any(step) for step in base_flags), base_flags
        assert len(res["grad_err"]) == 2 and max(res["grad_err"]) <= RTOL, res["grad_err"]
        assert res["param_err"] <= 1e-6, res["param_err"]
