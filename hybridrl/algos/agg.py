"""Loss aggregation of a per-token loss matrix into a scalar, invariant to DP sharding.

Modes (``loss_BT``, ``mask_BT`` [B, T]; ``s_b = sum_t loss_bt·m_bt``, ``n_b = sum_t m_bt``):

- ``token-mean``:              ``sum_b s_b / N_tokens``
- ``seq-mean-token-sum``:      ``sum_{b: n_b>0} s_b / N_seqs``
- ``seq-mean-token-mean``:     ``sum_{b: n_b>0} (s_b / (n_b + 1e-8)) / N_seqs``
- ``seq-mean-token-sum-norm``: ``sum_b s_b / L``  (Dr. GRPO; L a constant, default the padded T)

``N_tokens`` and ``N_seqs`` (sequences with at least one valid token) default to the local batch,
which is verl's single-batch behaviour. To aggregate over a global mini-batch that is split across
micro-batches and DP ranks, pass ``AggNormalizers`` holding the *global* counts (from
``compute_agg_normalizers``): each call then returns its share ``local numerator / global
normalizer · dp_size``. Hence, with ``dp_size = D``:

- summing a rank's micro-batch losses gives its share; the *mean* over ranks of the shares equals
  the DP=1 loss of the whole mini-batch, and so does DDP's mean of gradients;
- with ``dp_size = 1`` the plain *sum* over ranks and micro-batches equals the DP=1 loss.

A global normalizer of 0 (empty mini-batch) yields a zero loss rather than NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.algos.masked import masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class AggNormalizers:
    """Global normalizers for ``agg_loss``; None fields fall back to the local batch."""

    global_tokens: float | None = None  # valid tokens in the global mini-batch
    global_seqs: float | None = None  # sequences with >= 1 valid token in the global mini-batch
    loss_scale_factor: float | None = None  # L of seq-mean-token-sum-norm
    dp_size: int = 1  # multiplier so that DDP's gradient mean equals the global-batch gradient

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor}")


def check_agg_mode(loss_agg_mode: str) -> None:
    """ValueError unless ``loss_agg_mode`` is one of ``AGG_MODES``."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {loss_agg_mode!r}")


def _safe_div(num: torch.Tensor, den: float | torch.Tensor) -> torch.Tensor:
    den_t = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return num / torch.where(den_t > 0, den_t, torch.ones_like(den_t))


def agg_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm: AggNormalizers | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] loss matrix into a scalar (see the module docstring for the formulas)."""
    check_agg_mode(loss_agg_mode)
    norm = norm if norm is not None else AggNormalizers()
    mask_BT = mask_BT.to(loss_BT.dtype)
    n_tok_B = mask_BT.sum(dim=-1)  # [B]
    if loss_agg_mode == "token-mean":
        den = norm.global_tokens if norm.global_tokens is not None else n_tok_B.sum()
        return _safe_div(masked_sum(loss_BT, mask_BT), den) * norm.dp_size
    seq_sum_B = masked_sum(loss_BT, mask_BT, dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = norm.loss_scale_factor if norm.loss_scale_factor is not None else mask_BT.shape[-1]
        return seq_sum_B.sum() / scale * norm.dp_size
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum_B = seq_sum_B / (n_tok_B + 1e-8)
    seq_mask_B = (n_tok_B > 0).to(loss_BT.dtype)
    den = norm.global_seqs if norm.global_seqs is not None else seq_mask_B.sum()
    return _safe_div((seq_sum_B * seq_mask_B).sum(), den) * norm.dp_size


def compute_agg_normalizers(
    masks_BT: torch.Tensor | Sequence[torch.Tensor],
    dp_group: dist.ProcessGroup | None = None,
    loss_scale_factor: float | None = None,
) -> AggNormalizers:
    """Global token/sequence counts of a mini-batch, summed over micro-batches and DP ranks.

    ``masks_BT``: this rank's response mask of the mini-batch, or the list of its micro-batch
    masks. ``dp_group``: the data-parallel group (None: a single replica, no communication).
    ``loss_scale_factor`` (seq-mean-token-sum-norm) defaults to the largest padded T over ranks.
    Every rank of ``dp_group`` must call this (one all_reduce SUM and one all_reduce MAX).
    """
    masks = [masks_BT] if isinstance(masks_BT, torch.Tensor) else list(masks_BT)
    if not masks:
        raise ValueError("masks_BT must hold at least one [B, T] mask")
    device = masks[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # [tokens, seqs]
    for mask in masks:
        if mask.dim() != 2:
            raise ValueError(f"masks_BT must be [B, T] tensors, got shape {tuple(mask.shape)}")
        m = mask.to(torch.float64)
        counts[0] += m.sum()
        counts[1] += (m.sum(dim=-1) > 0).sum()
    max_len = torch.tensor([max(m.shape[-1] for m in masks)], dtype=torch.float64, device=device)
    dp_size = 1
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
        dist.all_reduce(max_len, op=dist.ReduceOp.MAX, group=dp_group)
        dp_size = dist.get_world_size(dp_group)
    scale = loss_scale_factor if loss_scale_factor is not None else float(max_len[0])
    return AggNormalizers(
        global_tokens=float(counts[0]),
        global_seqs=float(counts[1]),
        loss_scale_factor=scale,
        dp_size=dp_size,
    )
