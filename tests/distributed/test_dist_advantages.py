"""compute_advantage_dp on 2 gloo DP ranks equals compute_advantage on the whole batch for every
built-in estimator (row-local, group-local, and reinforce_plus_plus_baseline's local group means
with global whitening), prompt groups kept whole on a rank as the rollout partition does."""

from __future__ import annotations

from hybridrl.testing.dist import run_on_ranks

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _rank(rank, world):
    import torch
    import torch.distributed as dist

    from hybridrl.algos.advantages import compute_advantage
    from hybridrl.algos.dist_advantages import compute_advantage_dp

    g = torch.Generator().manual_seed(3)
    B, T = 12, 6
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lens[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lens - 1] = torch.randint(0, 3, (B,), generator=g).float()
    values = torch.randn(B, T, generator=g)
    index = [b // 3 for b in range(B)]  # groups of 3
    rows = [b for b in range(B) if index[b] % world == rank]  # whole groups per rank
    out = {}
    for name in ESTIMATORS:
        full_adv, full_ret = compute_advantage(name, rewards, mask, values=values, index=index)
        adv, ret = compute_advantage_dp(name, rewards[rows], mask[rows], rows=rows,
                                        dp_group=dist.group.WORLD, device="cpu",
                                        values=values[rows], index=[index[r] for r in rows])
        out[name] = (float((adv - full_adv[rows]).abs().max()),
                     float((ret - full_ret[rows]).abs().max()))
    return out


def test_dp_shards_equal_the_whole_batch():
    for res in run_on_ranks(_rank, 2, timeout=300):
        for name, (d_adv, d_ret) in res.items():
            assert d_adv < 1e-5 and d_ret < 1e-5, (name, d_adv, d_ret)
