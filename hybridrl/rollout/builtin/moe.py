"""The builtin engine's mixture-of-experts feed-forward (Qwen3-MoE) and its routing record.

Contract:
- ``route(x_TH, gate_EH, k, norm)`` -> (``weights_Tk``, ``ids_Tk``): router logits ``x @ gate.T``
  in the engine's dtype, softmax over all E experts in fp32, the k largest probabilities and
  their expert ids (``torch.topk`` order: descending), divided by their sum when ``norm``
  (Qwen3's ``norm_topk_prob``), then cast to ``x``'s dtype; what transformers'
  ``Qwen3MoeTopKRouter`` computes, and megatron-core's top-k router with softmax before top-k.
- ``experts_forward(x_TH, ids_Tk, weights_Tk, parts)``: sum over each token's k experts of
  weight · down(silu(gate(x)) · up(x)), where ``parts(e)`` lists expert e's (gate_up, down)
  sub-shards of this gen TP rank ([gate_k; up_k] rows, down columns: a slice of the expert's
  F); the result is this rank's partial sum over its F slices (the caller all-reduces over
  gen TP). Only the experts some token chose run, each on its tokens only.
- ``RoutingRecord(B, T, layers, k, device)``: ``ids`` [B, T, layers, k] int16 (-1 = not run)
  in the engine's own columns (``hybridrl.rollout.builtin.decode``'s layout); ``put(rows,
  start, L, ids_bSk)`` stores a forward's choice. ``aligned(valid_BT, width)`` returns
  [B, width, layers, k] with row b's token t (prompt then response, as the trainer's
  micro-batches number them from 0) at column t; -1 on padding and on each row's last token
  (never fed forward: its routing cannot change any log-prob of the row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(x_TH: torch.Tensor, gate_EH: torch.Tensor, k: int,
          norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k] in x's dtype, expert ids [T, k] int64); see the module doc."""
    probs_TE = torch.softmax(x_TH @ gate_EH.T, dim=-1, dtype=torch.float32)
    top_Tk, ids_Tk = torch.topk(probs_TE, k, dim=-1)
    if norm:
        top_Tk = top_Tk / top_Tk.sum(dim=-1, keepdim=True)
    return top_Tk.to(x_TH.dtype), ids_Tk


def experts_forward(x_TH: torch.Tensor, ids_Tk: torch.Tensor, weights_Tk: torch.Tensor,
                    parts: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]
                    ) -> torch.Tensor:
    """This gen TP rank's partial [T, H] of the chosen experts' weighted outputs."""
    out_TH = torch.zeros_like(x_TH)
    for e in torch.unique(ids_Tk).tolist():
        tok, slot = torch.nonzero(ids_Tk == e, as_tuple=True)
        xe = x_TH[tok]
        y = None
        for gate_up, down in parts(e):
            gate, up = (xe @ gate_up.T).chunk(2, dim=-1)  # each part: [gate_k; up_k]
            yk = (F.silu(gate) * up) @ down.T
            y = yk if y is None else y.add_(yk)
        out_TH.index_add_(0, tok, y * weights_Tk[tok, slot, None])
    return out_TH


class RoutingRecord:
    """Top-k expert ids of every forwarded token of one ``generate`` (see module doc)."""

    def __init__(self, B: int, T: int, layers: int, k: int, device) -> None:
        self.ids = torch.full((B, T, layers, k), -1, dtype=torch.int16, device=device)

    def put(self, rows: torch.Tensor, start: int, layer: int, ids_bSk: torch.Tensor) -> None:
        S = ids_bSk.shape[1]
        self.ids[rows, start:start + S, layer] = ids_bSk.to(torch.int16)

    def aligned(self, valid_BT: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width, layers, k]: row b's token t at column t (module doc); ``valid_BT`` marks
        the engine columns that hold each row's real tokens (prompt then response, in order)."""
        out = torch.full((self.ids.shape[0], width, *self.ids.shape[2:]), -1,
                         dtype=self.ids.dtype, device=self.ids.device)
        for b in range(self.ids.shape[0]):
            cols = torch.nonzero(valid_BT[b]).flatten()[:-1]  # the last token is never forwarded
            out[b, :len(cols)] = self.ids[b, cols]
        return out
