"""Multi-turn rollouts around a rollout worker: the loop runs where the engine is, above it.

Contract:
- ``build_multi_turn(cfg, tokenizer, worker)`` returns ``worker`` itself when
  ``rollout.multi_turn.enable`` is false or it is a ``MultiTurnWorker`` already, else a ``MultiTurnWorker`` around it (tools built and
  checked first: ``hybridrl.tools.registry.build_tools``; the format from the tokenizer:
  ``hybridrl.rollout.multi_turn.format``). A split placement's worker (no engine on the
  training ranks) is refused with one line: its generation ranks build their engine
  themselves (``hybridrl.rollout.split.server``) and would need the same wrap there.
- ``MultiTurnWorker`` answers everything the worker answers (``sync_weights``, ``release``,
  ``gen``, ...) and runs ``generate`` / ``generate_partitioned`` of the worker with its engine
  replaced, for that call only, by a ``LoopEngine`` (``generate`` = one ``AgentLoop.run``):
  every gen replica runs the loops of its own rows (DP-local), the worker's hand-off moves the
  tails like any response, and the receiving rank derives each row's loss mask from its ids
  (``format.loss_mask``). The outputs are ``LoopOutput``s (``loss_mask`` set; ``stats`` None
  on the receiving side). Weight syncs see the real engine.
- After each call the loop statistics of the whole batch are summed over the job (one
  all_reduce on every rank: each engine's source rank counts its rows once) and kept;
  ``pop_metrics(prefix)`` returns and clears them as ``<prefix>turns/mean``,
  ``tool_calls/mean``, ``tool_calls/rate`` (the fraction of sequences with at least one call),
  ``tool_errors``, ``tool_timeouts``, ``tokens/model``, ``tokens/tool`` and ``ended/<reason>``
  fractions.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hybridrl.rollout.multi_turn.format import build_format, loss_mask
from hybridrl.rollout.multi_turn.loop import STAT_KEYS, AgentLoop, Budgets, LoopOutput


class LoopEngine:
    """An engine whose ``generate`` runs the agent loop on the engine it wraps."""

    def __init__(self, engine, fmt, tools, budgets: Budgets) -> None:
        self.engine, self.fmt, self.tools, self.budgets = engine, fmt, tools, budgets
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    def _share(self):
        group = getattr(self.engine, "tp_group", None)  # builtin and SGLang engines have one
        if group is None or dist.get_world_size(group) <= 1:
            return None
        src = getattr(self.engine, "tp_src", None)  # builtin; SGLang: its members[0]
        src = int(self.engine.members[0] if src is None else src)

        def share(objects):
            box = [objects]
            dist.broadcast_object_list(box, src=src, group=group)
            return box[0]
        return share

    def generate(self, prompt_ids, params) -> LoopOutput:
        out = AgentLoop(self.engine, self.fmt, self.tools, self.budgets, self._share()).run(
            prompt_ids, params)
        for k, v in out.stats.items():
            self.stats[k] += v
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


class MultiTurnWorker:
    """A rollout worker whose generations are multi-turn rollouts (module docstring)."""

    def __init__(self, worker, fmt, tools, budgets: Budgets) -> None:
        self._worker, self.fmt, self.tools, self.budgets = worker, fmt, tools, budgets
        self._metrics: dict[str, float] = {}

    def __getattr__(self, name):
        return getattr(self._worker, name)

    @contextlib.contextmanager
    def _looping(self):
        real = self._worker.engine
        loop = LoopEngine(real, self.fmt, self.tools, self.budgets)
        self._worker.engine = loop
        try:
            yield loop
        finally:
            self._worker.engine = real

    def loss_mask(self, response_ids, response_mask) -> torch.Tensor:
        """The model's tokens of these tails, [N, R] (``format.loss_mask``)."""
        return loss_mask(self.fmt, response_ids, response_mask)

    def _finish(self, out, loop: LoopEngine) -> LoopOutput:
        mine = loop.stats if getattr(self._worker, "is_src", True) else dict.fromkeys(STAT_KEYS, 0)
        sums = torch.tensor([float(mine[k]) for k in STAT_KEYS], dtype=torch.float64)
        if dist.is_initialized():
            sums = sums.to(self._worker.device)
            dist.all_reduce(sums)
        self._metrics = dict(zip(STAT_KEYS, sums.cpu().tolist()))
        return LoopOutput(out.response_ids, out.response_mask, out.logprobs,
                          loss_mask=self.loss_mask(out.response_ids, out.response_mask))

    def generate(self, prompts, params, seed: int):
        with self._looping() as loop:
            out = self._worker.generate(prompts, params, seed)
        return self._finish(out, loop)

    def generate_partitioned(self, prompts, params, seed: int, plan_parts):
        with self._looping() as loop:
            mine, out, stats = self._worker.generate_partitioned(prompts, params, seed, plan_parts)
        return mine, self._finish(out, loop), stats

    def pop_metrics(self, prefix: str = "multi_turn/") -> dict[str, float]:
        """The last call's loop statistics over the whole batch (module docstring)."""
        m, self._metrics = self._metrics, {}
        if not m:
            return {}
        n = max(m["sequences"], 1.0)
        out = {f"{prefix}turns/mean": m["turns"] / n, f"{prefix}tool_calls/mean": m["tool_calls"] / n,
               f"{prefix}tool_calls/rate": m["with_calls"] / n,
               f"{prefix}tool_errors": m["tool_errors"], f"{prefix}tool_timeouts": m["tool_timeouts"],
               f"{prefix}tokens/model": m["model_tokens"], f"{prefix}tokens/tool": m["tool_tokens"]}
        for reason in ("answer", "budget", "turns", "tool_calls"):
            out[f"{prefix}ended/{reason}"] = m[f"ended_{reason}"] / n
        return out


def budgets_of(cfg) -> Budgets:
    mt = cfg.rollout.multi_turn
    return Budgets(max_tokens=cfg.rollout.response_length,
                   max_tokens_per_turn=mt.max_tokens_per_turn,
                   max_assistant_turns=mt.max_assistant_turns, max_tool_calls=mt.max_tool_calls,
                   max_parallel_calls=mt.max_parallel_calls)


def build_multi_turn(cfg, tokenizer, worker):
    """``worker``, or a ``MultiTurnWorker`` around it (module docstring)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or isinstance(worker, MultiTurnWorker):  # off, or wrapped already
        return worker
    if getattr(worker, "engine", None) is None:
        raise ValueError("rollout.multi_turn.enable with parallel.placement=split is not "
                         "supported yet (the generation ranks' server builds its engine "
                         "itself); use the colocated placement")
    from hybridrl.tools.registry import build_tools

    tools = build_tools(mt.tools, mt.tool_timeout_s or None, mt.max_tool_response_chars)
    fmt = build_format(mt.format, tokenizer, tools.schemas())
    return MultiTurnWorker(worker, fmt, tools, budgets_of(cfg))
