"""Routing replay (R3) for megatron-core MoE models: the training forward uses the rollout
engine's top-k expert choices, and counts how often its own routing agrees.

Contract:
- A micro-batch may carry ``routed_experts`` [b, W, layers, k] (row i's token t of
  prompt-then-response at column t, -1 where the engine ran no forward: ``RolloutBatch.
  routed_experts`` cut by ``microbatch``). ``megatron_order(routed, T, layer, cu_seqlens,
  sp_rank, sp_size)`` is layer ``layer``'s ids in the order megatron's router sees the tokens:
  [T, b] sequence-first flattened (a pack [1, S]: each sequence's tokens at its ``cu_seqlens``
  offset), the columns past W, the pack's tail and the padding -1; under sequence parallelism
  (``sp_size`` > 1) the rank's chunk of the sequence.
- ``replaying(module, batch, T)``: a context manager around the forward of ``module`` (a
  GPTModel stage) on ``batch`` with sequence length T: every TopKRouter of the stage (its
  global layer: ``layer_number - 1``) replays its layer's ids through megatron-core's
  ``RouterReplay`` API (``set_target_indices``, action ``REPLAY_FORWARD``): the router's
  scores are gathered at the replayed experts (so the gating weights are the trainer's own
  router's, and its gradient flows; only the choice is the engine's). A token with -1 ids uses
  the router's own top-k (it never influences a rollout token's log-prob: padding, or the last
  token of a row). The replay holders are this module's ``ReplayRecorder`` (a RouterReplay
  that is not put in megatron's class-level instance list), installed on first use.
- Each replayed call also computes the router's own top-k and counts the tokens (with
  engine ids) whose own expert SET equals the replayed one; ``pop_agreement(module)`` returns
  (agreeing, counted) over every call since the last pop and resets the counts: the trainer's
  ``actor/router_agreement`` = agreeing / counted (``agreement_metric``: summed over the DP
  ranks; each pipeline stage counts its own layers).
- Not covered: activation recomputation of the MoE layer (megatron's REPLAY_BACKWARD).
"""

from __future__ import annotations

import contextlib

import torch

ROUTED_KEY = "routed_experts"


def megatron_order(routed_bWLk: torch.Tensor, T: int, layer: int,
                   cu_seqlens: torch.Tensor | None = None, sp_rank: int = 0,
                   sp_size: int = 1) -> torch.Tensor:
    """Layer ``layer``'s replay ids [tokens, k] int64 in megatron's token order (module doc)."""
    b, W, _, k = routed_bWLk.shape
    ids_bWk = routed_bWLk[:, :, layer].long()
    if cu_seqlens is not None:  # a pack [1, S]: row i's tokens at cu[i]..cu[i+1]
        out = torch.full((T, k), -1, dtype=torch.long, device=ids_bWk.device)
        cu = cu_seqlens.tolist()
        for i in range(len(cu) - 1):
            n = min(cu[i + 1] - cu[i], W)
            out[cu[i]:cu[i] + n] = ids_bWk[i, :n]
        ids_Tbk = out[:, None]
    else:
        out = torch.full((b, T, k), -1, dtype=torch.long, device=ids_bWk.device)
        out[:, :min(T, W)] = ids_bWk[:, :T]
        ids_Tbk = out.transpose(0, 1)
    if sp_size > 1:  # sequence parallel: this rank's chunk of the sequence
        c = T // sp_size
        ids_Tbk = ids_Tbk[sp_rank * c:(sp_rank + 1) * c]
    return ids_Tbk.reshape(-1, k).contiguous()


def _recorder_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class ReplayRecorder(RouterReplay):
        """megatron's RouterReplay holder of one router, outside its global instance list,
        counting agreement on every replayed call (module doc)."""

        def __init__(self) -> None:  # not RouterReplay.__init__: no class-level list entry
            self.target_topk_idx = None
            self.recorded_topk_idx = None
            self.router_replay_action = None
            self.replay_backward_list = []
            self.agree = self.counted = 0

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            if (self.router_replay_action != RouterReplayAction.REPLAY_FORWARD
                    or self.target_topk_idx is None):
                return super().get_replay_topk(scores, topk, num_groups, group_topk,
                                               default_compute_topk)
            own = default_compute_topk(scores, topk, num_groups=num_groups,
                                       group_topk=group_topk)[1]
            target = self.target_topk_idx.to(scores.device)
            if target.shape != own.shape:
                raise ValueError(f"routing replay: {tuple(target.shape)} replayed ids for "
                                 f"{tuple(own.shape)} routed tokens x top-k (do the rollout's "
                                 "routed_experts belong to this micro-batch?)")
            known = (target >= 0).all(dim=-1)
            target = torch.where(known[:, None], target, own)
            same = (own.sort(-1).values == target.sort(-1).values).all(dim=-1) & known
            self.agree += int(same.sum())
            self.counted += int(known.sum())
            self.record_indices(target)
            return scores.gather(1, target), target

    return ReplayRecorder, RouterReplayAction


def _routers(module) -> list:
    """The stage's TopKRouters (they hold ``router_replay``), with their global layer index."""
    return [(m.layer_number - 1, m) for m in module.modules()
            if hasattr(m, "router_replay") and hasattr(m, "topk")]


@contextlib.contextmanager
def replaying(module, batch: dict, T: int, sp_rank: int = 0, sp_size: int = 1):
    """Replay ``batch[ROUTED_KEY]`` in every router of ``module`` during the block (module doc);
    a batch without it runs the routers' own routing."""
    routed = batch.get(ROUTED_KEY)
    if routed is None:
        yield
        return
    recorder, action = _recorder_class()
    cu = batch.get("cu_seqlens")
    routers = _routers(module)
    for layer, router in routers:
        if not hasattr(router.router_replay, "agree"):  # not a ReplayRecorder yet
            router.router_replay = recorder()
        ids = megatron_order(routed, T, layer, None if cu is None else cu.cpu(), sp_rank, sp_size)
        router.router_replay.set_target_indices(ids)
        router.router_replay.set_router_replay_action(action.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def pop_agreement(module) -> tuple[int, int]:
    """(tokens x layers whose own top-k set equalled the replayed one, counted) since the last
    pop; resets the counts."""
    agree = counted = 0
    for _, router in _routers(module):
        rr = router.router_replay
        if hasattr(rr, "agree"):
            agree, counted = agree + rr.agree, counted + rr.counted
            rr.agree = rr.counted = 0
    return agree, counted


def agreement_metric(module, dp_group=None, device="cpu") -> dict[str, float]:
    """``{"actor/router_agreement": agreeing / counted}`` since the last pop, summed over
    ``dp_group`` (every DP rank calls it); {} when nothing was counted."""
    import torch.distributed as dist

    counts = torch.tensor(pop_agreement(module), dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    agree, counted = counts.tolist()
    return {"actor/router_agreement": agree / counted} if counted else {}

