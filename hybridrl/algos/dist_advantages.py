"""Advantages on a DP rank's share of the batch, equal to the whole-batch computation.

Contract: ``compute_advantage_dp(name, rewards_BT, mask_BT, *, rows, dp_group, device, values,
index, **estimator_kwargs)`` takes this rank's rows (``rows``: their global indices, ascending;
the DP ranks' rows together are the batch, each row on exactly one DP rank) and returns
``(advantages_BT, returns_BT)`` for them, the numbers ``compute_advantage`` gives on the whole
batch:
- ``gae``, ``reinforce_plus_plus`` (``ROW_LOCAL``): the per-row recurrences on the rank's rows,
  whitened with the whole batch's masked moments (``global_masked_whiten``: two all_reduces of
  scalars over ``dp_group``);
- ``grpo``, ``rloo`` (``GROUP_LOCAL``): the rank holds whole prompt groups
  (``hybridrl.rollout.partition`` keeps them together), so group statistics are local;
- ``reinforce_plus_plus_baseline`` (``GROUP_WHITEN``): local group means, then the whole
  batch's whitening moments (``global_masked_whiten``);
- any other registered estimator sees the whole batch, as its contract says: the rows' rewards,
  mask, values and ``index`` are all-gathered over ``dp_group`` (a fallback that moves [N, R]
  floats; the built-in estimators never take it) and the rank keeps its rows' outputs.
``needs_groups(name)``: whether the partition must keep the n samples of a prompt together.
Collectives run on ``device`` (NCCL takes no CPU tensors); outputs are on the inputs' device.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from hybridrl.algos.advantages import compute_advantage

ROW_LOCAL = ("gae", "reinforce_plus_plus")
GROUP_LOCAL = ("grpo", "rloo")
GROUP_WHITEN = ("reinforce_plus_plus_baseline",)


def needs_groups(name: str) -> bool:
    """True unless the estimator is row-local (then rows may be split freely)."""
    return name not in ROW_LOCAL


def global_masked_whiten(values: torch.Tensor, mask: torch.Tensor, group, device) -> torch.Tensor:
    """``masked_whiten`` with the mean and unbiased variance of every rank's masked entries."""
    m = mask.to(values.dtype)
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    sums = torch.stack([(kept * m).sum().double(), m.sum().double()]).to(device)
    dist.all_reduce(sums, group=group)
    n = float(sums[1])
    if n < 2:
        raise ValueError(f"mask: the whole batch has {n:g} valid tokens; whitening needs >= 2")
    mean = (sums[0] / (sums[1] + 1e-8)).to(values.dtype).cpu().to(values.device)
    dev = torch.where(mask.bool(), values - mean, torch.zeros_like(values))
    ssq = (dev * dev * m).sum().double().reshape(1).to(device)
    dist.all_reduce(ssq, group=group)
    var = (ssq[0] / (sums[1] + 1e-8) * (n / (n - 1))).to(values.dtype).cpu().to(values.device)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _whole_batch(name, rewards, mask, rows, values, index, group, device, kwargs):
    """Gather the batch over DP (row order), run the estimator, keep this rank's rows."""
    n = torch.tensor([len(rows)], device=device)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    n_max, R = int(max(int(s) for s in sizes)), rewards.shape[1]
    cols = [rewards.float(), mask.float()] + ([values.float()] if values is not None else [])
    floats = torch.zeros(n_max, len(cols) * R, device=device)
    floats[:len(rows)] = torch.cat(cols, dim=1).to(device)
    ints = torch.full((n_max, 2), -1, dtype=torch.long, device=device)  # (row, group id)
    ints[:len(rows), 0] = torch.tensor(rows, device=device)
    ints[:len(rows), 1] = torch.as_tensor([int(i) for i in index], device=device)
    parts_f = [torch.empty_like(floats) for _ in sizes]
    parts_i = [torch.empty_like(ints) for _ in sizes]
    dist.all_gather(parts_f, floats, group=group)
    dist.all_gather(parts_i, ints, group=group)
    all_f, all_i = torch.cat(parts_f).cpu(), torch.cat(parts_i).cpu()
    keep = all_i[:, 0] >= 0
    all_f, all_i = all_f[keep], all_i[keep]
    order = torch.argsort(all_i[:, 0])
    all_f, all_i = all_f[order], all_i[order]
    full = [all_f[:, k * R:(k + 1) * R] for k in range(len(cols))]
    adv, ret = compute_advantage(name, full[0], full[1], values=full[2] if values is not None
                                 else None, index=all_i[:, 1].tolist(), **kwargs)
    where = {int(r): j for j, r in enumerate(all_i[:, 0])}
    pick = torch.tensor([where[r] for r in rows], dtype=torch.long)
    return adv[pick].to(rewards.device), ret[pick].to(rewards.device)


@torch.no_grad()
def compute_advantage_dp(name: str, rewards: torch.Tensor, mask: torch.Tensor, *,
                         rows: list[int], dp_group, device, values: torch.Tensor | None = None,
                         index=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (advantages [n, R], returns [n, R]) (see the module docstring)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return compute_advantage(name, rewards, mask, values=values, index=index, **kwargs)
    if name in ROW_LOCAL or name in GROUP_WHITEN:
        whiten = functools.partial(global_masked_whiten, group=dp_group, device=device)
        return compute_advantage(name, rewards, mask, values=values, index=index,
                                 whiten=whiten, **kwargs)
    if name in GROUP_LOCAL:
        return compute_advantage(name, rewards, mask, values=values, index=index, **kwargs)
    return _whole_batch(name, rewards, mask, rows, values, index, dp_group, device, kwargs)
