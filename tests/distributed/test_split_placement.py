"""Split placement (issue 29): generation ranks apart from the training ranks.

One 4-rank gloo launch, the tiny GAE run of test_trainer_cases (critic, KL loss, 2 mini-batches)
with 3 steps; smaller jobs run inside it on ranks 0..n-1 (``default_group``):
- split 2 + 2 (train dp 2; 2 gen replicas) vs colocated on 2 ranks (dp 2; 2 gen replicas), and
  split 1 + 1 vs colocated on 1 rank, async_steps 0: the same metrics step for step (timing,
  perf, reshard and transport figures aside) and the same final actor weights;
- async_steps 1 on 1 + 1 (3 steps, a checkpoint and a validation after each): staleness 0 then
  1, an overlap figure, the update uses the recomputed old log-probs; then a resume from its
  step-1 checkpoint (the batch in flight saved in it) logs exactly steps 2 and 3 of the
  uninterrupted run and ends with the same weights;
- the generation ranks' batch counts: each batch generated once (a validation between a
  prefetch and its step does not displace the prefetched batch; the resume regenerates none).
"""

from __future__ import annotations

import math
import os

import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed.test_trainer_cases import base_overrides, run_in

SKIP = ("timing_s/", "perf/", "reshard/", "rollout/", "transport/")


def _job(rank, world, n, overrides, split, sub, world_group):
    """Run one job on ranks 0..n-1 (``sub``; the others return None at once)."""
    import torch
    import torch.distributed as dist

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.split import default_group
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.split_run import fit_split

    # torch names new groups by a per-process count: a job on ranks 0..n-1 advances only theirs,
    # so every rank takes the largest count before the next job (inside one job all agree)
    count = torch.tensor([dist.distributed_c10d._world.group_count])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=world_group)
    dist.distributed_c10d._world.group_count = int(count)
    if rank >= n:
        return None
    out = {}
    with default_group(sub, new_groups=True):
        cfg = load_config([], overrides, world_size=n)
        train, gen = build_layout(cfg, n)
        torch.manual_seed(cfg.trainer.seed)

        def keep(tr):
            out["weights"] = {k: p.detach().clone() for k, p in tr.actor.module.named_parameters()}

        if split:
            out["hist"] = fit_split(cfg, train, 120, print_fn=lambda *a, **k: None, on_trainer=keep)
        else:
            tr = PPOTrainer(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
            out["hist"] = tr.fit()
            keep(tr)
        dist.barrier()
    return out


def _rank(rank, world, root):
    base = [*base_overrides(root), "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
            "trainer.total_steps=3", "trainer.logger=[console]"]
    split = ["parallel.placement=split"]
    import torch.distributed as dist

    # made up front, every rank in one order (a job's own groups advance only its ranks' count)
    subs = {n: dist.new_group(list(range(n))) for n in (1, 2, 4)}
    res = {}
    for name, n, extra, is_split in (
            ("split22", 4, [*split, "parallel.gen.world=2"], True),
            ("colo2", 2, [], False),
            ("split11", 2, [*split, "parallel.gen.world=1"], True),
            ("colo1", 1, [], False),
            ("async", 2, [*split, "parallel.gen.world=1", "rollout.async_steps=1",
                          "trainer.save_freq=1", "trainer.test_freq=1"], True),
            ("resumed", 2, [*split, "parallel.gen.world=1", "rollout.async_steps=1",
                            "trainer.test_freq=1",
                            "trainer.resume=path",
                            f"trainer.resume_path={root}/async/checkpoints/global_step_1"], True)):
        res[name] = _job(rank, world, n, [*base, *extra, *run_in(f"{root}/{name}")], is_split,
                         subs[n], subs[4])
    return res


def _same(a_hist, b_hist):
    assert len(a_hist) == len(b_hist)
    for step, (a, b) in enumerate(zip(a_hist, b_hist), 1):
        keys = {k for k in a if not k.startswith(SKIP)} & {k for k in b if not k.startswith(SKIP)}
        assert len(keys) > 10, sorted(keys)
        for k in sorted(keys):
            x, y = a[k], b[k]
            assert x == y or (math.isnan(x) and math.isnan(y)), (step, k, x, y)


@pytest.mark.slow
def test_split_placement(tmp_path):
    res = run_on_ranks(_rank, 4, str(tmp_path), timeout=900, preload=("megatron.core",))
    import torch

    r0 = res[0]
    _same(r0["split22"]["hist"], r0["colo2"]["hist"])
    _same(r0["split11"]["hist"], r0["colo1"]["hist"])
    for a, b in (("split22", "colo2"), ("split11", "colo1")):
        for k, w in r0[a]["weights"].items():
            assert torch.equal(w, r0[b]["weights"][k]), (a, k)
    assert res[2]["split22"]["hist"] == res[3]["split22"]["hist"] == 3  # batches generated
    # async: 3 training batches + 3 validations, each once (a validation between a prefetch and
    # its step does not displace the prefetched batch); the resume regenerates nothing
    assert res[1]["async"]["hist"] == 6 and res[1]["resumed"]["hist"] == 3
    asy = r0["async"]["hist"]
    assert [m["rollout/staleness"] for m in asy] == [0.0, 1.0, 1.0]
    # which weights generated each batch: syncs are step k's (number 2k - 1) and validation
    # k's (2k); batch 1 after sync 1 (w_0), batch k >= 2 right after step k-1's sync (2k - 3:
    # w_{k-2}), before validation k-1's
    assert [m["rollout/gen_syncs"] for m in asy] == [1.0, 1.0, 3.0]
    # the first batch has nothing to hide behind; later ones overlap a step, measured (4 ranks on
    # 2 cores can starve the generation rank for one step), so at least one of the two must
    assert asy[0]["timing_s/overlap"] == 0.0
    assert max(m["timing_s/overlap"] for m in asy[1:]) > 0 and min(
        m["timing_s/overlap"] for m in asy) >= 0, [m["timing_s/overlap"] for m in asy]
    assert all("val/score/mean" in m for m in asy)
    # old log-probs are the trainer's forward on w_{k-1}, not the engine's on w_{k-2}: their gap
    # is that of one optimizer step, far above the sync run's engine-vs-trainer rounding
    gap, sync = "training/rollout_logprob_diff", r0["split11"]["hist"]
    for k in (1, 2):
        assert asy[k][gap] > max(10 * sync[k][gap], 1e-6), (k, asy[k][gap], sync[k][gap])
    resumed = r0["resumed"]["hist"]
    assert len(resumed) == 2
    # batch 2 from the checkpoint (sync 1 of the first process); the resumed process's
    # generation rank counts from 0: batch 3 after step 2's sync, its first
    assert [m["rollout/gen_syncs"] for m in resumed] == [1.0, 1.0]
    _same(resumed, asy[1:])
    for k, w in r0["async"]["weights"].items():
        assert torch.equal(w, r0["resumed"]["weights"][k]), k
    assert os.path.isdir(f"{tmp_path}/async/checkpoints/global_step_1")
