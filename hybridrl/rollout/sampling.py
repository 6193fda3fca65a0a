"""Next-token choice from full-vocabulary logits: greedy, temperature, top-k, top-p (pure torch).

Contract: ``sample_next(logits_BV, params, generator) -> (tokens_B, logprobs_B)``.
- greedy (temperature 0): ``argmax``; its log-prob is taken under ``log_softmax(logits)`` (T = 1).
- otherwise ``z = logits / T``; top-k keeps the k largest, top-p keeps the smallest prefix of the
  descending-probability order whose mass reaches ``top_p`` (the most likely token always stays);
  the token is drawn from the renormalized kept mass with ``torch.multinomial(generator=...)``;
  given a list of generators (one per row), row b draws with its own generator.
- the returned log-prob is that of the chosen token under the *unfiltered* ``log_softmax(z)``
  (what the actor recomputes at the same temperature), fp32.
``filter_logits`` is the top-k/top-p masking on its own (masked entries are -inf).
``request_seed(seed, i)``: the seed of request i of a generate call (every engine, every
placement: a sequence's sample does not depend on the layout; fits SGLang's int64).
"""

from __future__ import annotations

import torch

from hybridrl.rollout.base import SamplingParams


def filter_logits(z_BV: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """``z_BV`` with everything outside top-k / top-p set to -inf (a new tensor)."""
    out = z_BV.clone()
    if top_k != -1 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [B, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p  # the first token always has mass_before 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next(
    logits_BV: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, log-probs [B] fp32) of the next token (see module docstring)."""
    logits_BV = logits_BV.float()
    if params.greedy:
        tokens_B = logits_BV.argmax(dim=-1)
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
    else:
        z_BV = logits_BV / params.temperature
        logp_BV = torch.log_softmax(z_BV, dim=-1)
        kept_BV = filter_logits(z_BV, params.top_k, params.top_p)
        probs_BV = torch.softmax(kept_BV, dim=-1)
        if isinstance(generator, list):  # one generator per row: [B]
            tokens_B = torch.cat([torch.multinomial(probs_BV[b:b + 1], 1, generator=g)[:, 0]
                                  for b, g in enumerate(generator)])
        else:
            tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    return tokens_B, logp_BV.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1)


def request_seed(seed: int, index: int) -> int:
    """Seed of request ``index`` of a generate call with base ``seed`` (fits SGLang's int64)."""
    return (seed * 1_000_003 + index) % (2**63 - 1)
