"""Multi-turn rollouts around a rollout worker: the loop runs where the engine is, above it.

Contract:
- ``build_multi_turn(cfg, tokenizer, worker)`` returns ``worker`` itself when
  ``rollout.multi_turn.enable`` is false or it is a ``MultiTurnWorker`` already, else a ``MultiTurnWorker`` around it (tools built and
  checked first: ``hybridrl.tools.registry.build_tools``; the format from the tokenizer:
  ``hybridrl.rollout.multi_turn.format``). A split placement's worker has no engine on the
  training ranks: its generation ranks run the loop themselves (``loop_engine_of(cfg,
  tokenizer, engine)`` in ``hybridrl.rollout.split.server``), the wrapper only derives the loss
  mask of the received tails and their statistics (``mask_stats``: sequences, turns, tool
  calls, tokens by source; the tool errors, timeouts and end reasons stay on the generation
  ranks and are not reported), counted once per DP replica.
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
from hybridrl.tools.registry import build_tools


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
        real = getattr(self._worker, "engine", None)
        if real is None:  # split placement: the loop runs on the generation ranks
            yield None
            return
        loop = LoopEngine(real, self.fmt, self.tools, self.budgets)
        self._worker.engine = loop
        try:
            yield loop
        finally:
            self._worker.engine = real

    def loss_mask(self, response_ids, response_mask) -> torch.Tensor:
        """The model's tokens of these tails, [N, R] (``format.loss_mask``)."""
        return loss_mask(self.fmt, response_ids, response_mask)

    def _finish(self, out, loop: LoopEngine | None) -> LoopOutput:
        mask = self.loss_mask(out.response_ids, out.response_mask)
        if loop is None:  # split: counted from the received tails, once per DP replica
            g = self._worker.groups
            keys = MASK_STAT_KEYS
            mine = (mask_stats(mask, out.response_mask) if g.tp_rank == 0 and g.pp_rank == 0
                    else dict.fromkeys(keys, 0))
        else:
            keys = STAT_KEYS
            mine = (loop.stats if getattr(self._worker, "is_src", True)
                    else dict.fromkeys(keys, 0))
        sums = torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64)
        if dist.is_initialized():
            sums = sums.to(self._worker.device)
            dist.all_reduce(sums)
        self._metrics = dict(zip(keys, sums.cpu().tolist()))
        return LoopOutput(out.response_ids, out.response_mask, out.logprobs, loss_mask=mask)

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
               f"{prefix}tokens/model": m["model_tokens"], f"{prefix}tokens/tool": m["tool_tokens"]}
        if "tool_errors" in m:  # the loop's own record (not in split placement: see mask_stats)
            out[f"{prefix}tool_errors"] = m["tool_errors"]
            out[f"{prefix}tool_timeouts"] = m["tool_timeouts"]
            for reason in ("answer", "budget", "turns", "tool_calls"):
                out[f"{prefix}ended/{reason}"] = m[f"ended_{reason}"] / n
        return out


MASK_STAT_KEYS = ("sequences", "with_calls", "turns", "tool_calls", "model_tokens", "tool_tokens")


def mask_stats(loss_mask_NR: torch.Tensor, response_mask_NR: torch.Tensor) -> dict[str, int]:
    """The loop statistics a tail's masks show (split placement, where the loop ran on the
    generation ranks): model turns = runs of model tokens, tool calls = runs of other tokens
    between or after them (a tool's output with the format's template tokens)."""
    model = loss_mask_NR.bool() & response_mask_NR.bool()
    other = response_mask_NR.bool() & ~model
    pad = torch.zeros(model.shape[0], 1, dtype=torch.bool)

    def runs(x):  # starts of runs of True per row
        return (x & ~torch.cat([pad, x[:, :-1]], 1)).sum(1)

    turns, calls = runs(model), runs(other)
    return {"sequences": int(model.shape[0]), "with_calls": int((calls > 0).sum()),
            "turns": int(turns.sum()), "tool_calls": int(calls.sum()),
            "model_tokens": int(model.sum()), "tool_tokens": int(other.sum())}


def _loop_parts(cfg, tokenizer):
    """(format, tools, budgets) of ``rollout.multi_turn`` (tools built and checked first)."""
    mt = cfg.rollout.multi_turn
    tools = build_tools(mt.tools, mt.tool_timeout_s or None, mt.max_tool_response_chars)
    return build_format(mt.format, tokenizer, tools.schemas()), tools, budgets_of(cfg)


def loop_engine_of(cfg, tokenizer, engine) -> LoopEngine:
    """``engine`` wrapped in the agent loop of ``rollout.multi_turn`` (a split placement's
    generation ranks: ``hybridrl.rollout.split.server``)."""
    return LoopEngine(engine, *_loop_parts(cfg, tokenizer))


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
    return MultiTurnWorker(worker, *_loop_parts(cfg, tokenizer))
