"""Continuation across calls: a caller's sequences keep their K/V in the builtin engine between
``generate`` calls, and a later call prefills only what was appended since.

Contract:
- ``BuiltinEngine.open_session()`` -> ``KVSession``; ``session.generate(prompt_ids, params,
  keys)`` is ``engine.generate`` where row b is the sequence named ``keys[b]`` (any hashable,
  distinct within the call): a row whose sequence has a kept cache continues from it (the
  longest common prefix of the kept tokens and the new prompt is reused, the rest prefilled:
  ``hybridrl.rollout.builtin.decode``), and after the call every row that ended on a stop id
  keeps its K/V under its key (replacing what it had; a row cut by ``max_new_tokens`` keeps
  nothing). Outputs equal ``engine.generate``'s on the same prompts and params (up to matmul
  rounding: log-probs within ~1e-6 in fp32), with the same rows, seeds and TP collectives.
- ``drop(keys)`` frees sequences at once (an agent loop drops a sequence when it ends);
  ``close()`` (or leaving a ``with`` block) frees all. The session holds at most, per kept
  sequence, the K/V of its prompt and response minus one token: what the call that produced
  it already held for that row, without padding. ``held_tokens()`` counts them.
- Every rank of one gen TP group drives its own engine's session with the same calls.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists


class KVSession:
    """Kept caches of one caller's sequences on one engine (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rows: dict = {}  # key -> decode.KeptRow

    def generate(self, prompt_ids, params: SamplingParams,
                 keys: Iterable[Hashable]) -> GenerationOutput:
        prompts, keys = as_prompt_lists(prompt_ids), list(keys)
        if len(keys) != len(prompts) or len(set(keys)) != len(keys):
            raise ValueError(f"session.generate needs one distinct key per prompt, got "
                             f"{len(keys)} keys ({len(set(keys))} distinct) for {len(prompts)}")
        resume = [self.rows.pop(k, None) for k in keys]  # replaced by what this call keeps
        out, kept = self.engine._run(prompts, params, resume, keep=True)
        for b, row in kept.items():
            self.rows[keys[b]] = row
        return out

    def drop(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            self.rows.pop(k, None)

    def held_tokens(self) -> int:
        return sum(len(r) for r in self.rows.values())

    def close(self) -> None:
        self.rows.clear()

    def __enter__(self) -> KVSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
