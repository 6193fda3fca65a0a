"""The rollout-engine protocol: what the PPO loop needs from any generation engine.

Contract:
- An engine holds one generation shard of the policy (its gen TP rank's tensors in the *engine
  format* of ``hybridrl.reshard.formats.engine_format``: HF names, packed ``qkv_proj`` = [q; k; v]
  and ``gate_up_proj`` = [gate; up] per gen TP rank, vocab-parallel ``embed_tokens``/``lm_head``).
- ``update_weights(named_tensors)`` takes any subset of those tensors, any number of times (the
  reshard calls it once per non-empty bucket, and ranks of one gen TP group may call it different
  numbers of times); it must not communicate. Unknown names or wrong shapes raise ``ValueError``.
- ``finish_update()`` is called exactly once per weight sync, after the last ``update_weights``,
  by every rank of the gen TP group; it may run collectives over that group (SGLang gathers the
  buffered shards there) and is a no-op for engines that load in ``update_weights`` (builtin).
- ``generate(prompt_ids, params)``: ``prompt_ids`` is a list of B token-id lists (or a [B, P]
  tensor of real tokens); every rank of one gen TP group calls it with the same prompts and
  params and gets the same ``GenerationOutput``: ``response_ids`` [B, R] right-padded with
  ``params.pad_token_id``, ``response_mask`` [B, R] (1 on generated tokens, the eos included),
  ``logprobs`` [B, R] fp32 (0 on padding) of each sampled token under the *temperature-scaled,
  unfiltered* distribution ``log_softmax(logits / T)`` (T = 1 when greedy), which is what the
  actor recomputes; R <= ``params.max_new_tokens``. A mixture-of-experts engine may also fill
  ``routed_experts`` [B, P + R, layers, k] (P = the longest prompt): the top-k expert ids (global
  numbering, as in the HF checkpoint) its router chose for each token of each layer, row b's
  token t of prompt-then-response at column t, -1 where the engine ran no forward (padding,
  each row's last token); dense engines leave it None.
- ``SamplingParams`` validates its fields (``ValueError`` naming the field): temperature 0 means
  greedy; ``top_k`` -1 = off; ``top_p`` in (0, 1]; ``seed`` makes sampling reproducible;
  ``row_seeds`` (one per prompt) gives each request its own seed instead, so a sequence's sample
  does not depend on which other prompts share its batch (layout-invariant rollouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    eos_token_id: int | None = None
    pad_token_id: int = 0
    seed: int = 0
    row_seeds: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()  # more ids that end a row (kept, like eos): a
    # tool-call marker or end of turn in a multi-turn rollout

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.row_seeds is not None and not isinstance(self.row_seeds, tuple):
            raise ValueError(f"row_seeds must be a tuple of ints or None, got "
                             f"{type(self.row_seeds).__name__}")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple of ints, got "
                             f"{type(self.stop_token_ids).__name__}")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a row: ``eos_token_id`` (when set) and ``stop_token_ids``."""
        eos = () if self.eos_token_id is None else (int(self.eos_token_id),)
        return eos + tuple(int(t) for t in self.stop_token_ids if t != self.eos_token_id)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class GenerationOutput:
    """Responses of one ``generate`` call (see the module docstring)."""

    response_ids: torch.Tensor  # [B, R] int64, right-padded
    response_mask: torch.Tensor  # [B, R] int64
    logprobs: torch.Tensor  # [B, R] float32
    routed_experts: torch.Tensor | None = None  # MoE engines: [B, P + R, layers, k] int16 top-k
    # expert ids, row b's token t (prompt then response) at column t, -1 where not run

    def __len__(self) -> int:
        return self.response_ids.shape[0]


class RolloutEngine(Protocol):
    """What the trainer calls; ``BuiltinEngine`` and ``SGLangEngine`` implement it."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def finish_update(self) -> None: ...

    def generate(self, prompt_ids, params: SamplingParams) -> GenerationOutput: ...


def as_prompt_lists(prompt_ids) -> list[list[int]]:
    """Prompts as lists of ints from a list of lists / tensors or a [B, P] tensor; validated."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids tensor must be [B, P], got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    out = [[int(t) for t in p] for p in prompt_ids]
    if not out:
        raise ValueError("prompt_ids must hold at least one prompt, got 0")
    empty = [i for i, p in enumerate(out) if not p]
    if empty:
        raise ValueError(f"prompt_ids: prompts {empty[:5]} are empty; every prompt needs a token")
    return out
