"""The micro-batches of a step's model forwards, and the tally of the tokens they compute.

Contract:
- ``forward_parts(seq_lens, micro, dynamic, max_tokens, packed)``: this rank's rows
  (``range(len(seq_lens))``) as micro-batches for a forward-only pass (old / reference
  log-probs, values, reward model): ``micro`` rows each, or with ``dynamic`` the token-budget
  plan of ``hybridrl.data.batching.plan_micro_batches`` (``packed``: the budget counts real
  tokens; at least ``min_count`` micro-batches where the rows allow: the trainer passes pp;
  ``groups``: a prompt group per row, kept in one pack where the budget allows, for
  ``share_prompts``).
- ``sp_multiple(model)``: the multiple a micro-batch's length is padded to before the forward
  (tp under sequence parallelism, else 1; ``hybridrl.models.forward.pad_to_multiple``).
- ``replay_tensors(actor_cfg, rb)``: the per-row tensors that make the actor's forwards replay
  the rollout's MoE routing: ``{"routed_experts": rb.routed_experts}`` with
  ``actor.router_replay == "rollout"`` (a batch without them: ValueError), else {}; pass them to
  ``rb.microbatch`` for the old log-probs and the update alike.
- ``share_prompts(model_cfg, model, replay)``: whether ``model``'s micro-batches compute each
  shared prompt once (``RolloutBatch.microbatch(share=True)``): ``model.pack_sequences`` and
  ``model.share_prompts``, no routing replay (MoE ids are per row), and a forward that takes it
  (``hybridrl.models.forward.shares_prompts``: not the TE spec, recompute or megatron's own
  attention) and no MoE load-balancing / z loss (``moe_token_losses``: megatron means them over
  a micro-batch's tokens); when the model cannot, a line says why once per model and packing
  goes on without.
- ``TokenTally``: ``with tally.count(mbs, multiple):`` around a forward (or forward-backward)
  over micro-batches adds their real and computed tokens (``hybridrl.models.packing.
  token_counts``) and the seconds it took. ``pop_metrics(dp_group)`` returns the step's
  ``perf/pad_fraction`` (share of the computed tokens that are padding: 1 - real / computed,
  summed over the DP ranks) and ``perf/tokens_per_s`` (real tokens of all DP ranks / the
  slowest DP rank's seconds inside the counted forwards), ``perf/shared_prompt_frac`` (share of
  the rows' own tokens, each row counting its prompt, that shared prompts spared the forwards:
  1 - real / row tokens; 0 without sharing) and starts over; {} when nothing was
  counted. Every rank of a DP replica counts the same micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist

from hybridrl.data.batching import plan_micro_batches
from hybridrl.models.forward import shares_prompts
from hybridrl.models.packing import token_counts
from hybridrl.models.router_replay import ROUTED_KEY


def forward_parts(seq_lens: list[int], micro: int, dynamic: bool, max_tokens: int,
                  packed: bool, min_count: int = 1, groups=None) -> list[list[int]]:
    """Row indices of each forward-only micro-batch (see the module docstring)."""
    if dynamic:
        return plan_micro_batches(seq_lens, max_tokens, min_count, packed=packed,
                                  groups=groups).micro_batches
    rows = list(range(len(seq_lens)))
    return [rows[s:s + micro] for s in range(0, len(rows), micro)]


def replay_tensors(actor_cfg, rb) -> dict:
    """{"routed_experts": [N, P+R, layers, k]} when the actor replays the rollout's routing."""
    if getattr(actor_cfg, "router_replay", "off") != "rollout":
        return {}
    if rb.routed_experts is None:
        raise ValueError("actor.router_replay=rollout: the rollout batch carries no routed "
                         "expert ids (only the builtin engine returns them, for a MoE model, "
                         "and only the colocated hand-off brings them to the batch)")
    return {ROUTED_KEY: rb.routed_experts}


def share_prompts(model_cfg, model, replay=None) -> bool:
    """True when ``model``'s micro-batches share their prompts (see the module docstring)."""
    if not (model_cfg.pack_sequences and model_cfg.share_prompts) or replay:
        return False
    able = model.__dict__.get("_hybridrl_shares_prompts")
    if able is None:
        why = None
        if not shares_prompts(model):
            why = ("its attention is not the local spec's lean forward (TE spec, recompute or "
                   "another megatron-only option)")
        elif moe_token_losses(model):
            why = ("its MoE load-balancing / z loss is a mean over a micro-batch's tokens, which "
                   "a shared prompt would enter once instead of once per row")
        able = model.__dict__["_hybridrl_shares_prompts"] = why is None
        if not able:
            logging.getLogger(__name__).warning(
                "hybridrl: model.share_prompts is off for the %s: %s; packs compute each row's "
                "prompt", getattr(model, "role", "model"), why)
    return able


def sp_multiple(model) -> int:
    """tp under sequence parallelism (the forward pads T to it), else 1."""
    sp = getattr(model.config, "sequence_parallel", False)
    return model.groups.tp_size if sp and model.groups.tp_size > 1 else 1


class TokenTally:
    """Real and computed tokens of a step's forwards, and their seconds."""

    def __init__(self) -> None:
        self.real = self.computed = self.rows = 0  # rows: the rows' own tokens, prompts each
        self.seconds = 0.0

    @contextlib.contextmanager
    def count(self, microbatches, multiple: int = 1):
        real, computed = token_counts(microbatches, multiple)
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_initialized():  # the kernels' time, not their launch's
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.real += real
        self.computed += computed
        self.rows += sum(int(mb["seq_lens"].sum()) if "seq_lens" in mb
                         else token_counts([mb])[0] for mb in microbatches)

    def pop_metrics(self, dp_group=None) -> dict[str, float]:
        sums = torch.tensor([float(self.real), float(self.computed), float(self.rows)],
                            dtype=torch.float64)
        peak = torch.tensor([self.seconds], dtype=torch.float64)
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=dp_group)
        self.__init__()
        real, computed, rows = sums.tolist()
        if computed <= 0:
            return {}
        return {"perf/pad_fraction": 1.0 - real / computed,
                "perf/shared_prompt_frac": max(0.0, 1.0 - real / max(rows, 1.0)),
                "perf/tokens_per_s": real / max(float(peak[0]), 1e-9)}


def moe_token_losses(model) -> bool:
    """True when ``model`` is a MoE with an auxiliary load-balancing or z loss: megatron takes
    them over each micro-batch's tokens, so a shared prompt's tokens would count once, not once
    per row, and the gradients would differ from the unshared pack's."""
    config = getattr(model, "config", None)
    if not getattr(config, "num_moe_experts", None):
        return False
    aux = getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0
    z = getattr(config, "moe_z_loss_coeff", None) or 0.0
    return any(float(c) > 0 for c in (aux if isinstance(aux, (list, tuple)) else [aux])) or z > 0
