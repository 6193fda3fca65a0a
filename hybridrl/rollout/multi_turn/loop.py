"""The agent loop: each sequence alternates model turns and tool outputs until it answers or a
budget ends it; one engine call per turn for every live sequence.

Contract:
- ``AgentLoop(engine, fmt, tools, budgets, share=None, continuation=True)``; ``run(prompts, params)`` ->
  ``LoopOutput``: the ``GenerationOutput`` of the whole tails after the prompts
  (``response_ids`` / ``response_mask`` / ``logprobs`` [B, R], R <= ``budgets.max_tokens``:
  model turns, tool segments and template tokens; the engine's log-probs on model tokens, 0
  elsewhere) plus ``loss_mask`` [B, R] (1 on model tokens) and ``stats`` (sums over the
  batch, ``STAT_KEYS``).
- Each round calls the engine once with every live sequence's whole context (prompt + tail)
  as its prompt (more calls, longest contexts first, when the engine bounds prompt + new
  tokens together, the builtin engine's ``spec.max_seq_len``, and one call would pass it),
  ``params`` with the format's stop ids added, ``max_new_tokens`` = the largest per-sequence
  allowance (each row is then cut to its own: ``min(budgets.max_tokens_per_turn, what is
  left of budgets.max_tokens)``) and per-turn seeds (turn 0 keeps ``params``' seeds, so a
  sequence that answers at once samples what a single-turn rollout samples; ``row_seeds``
  keep rollouts independent of the batch).
- Continuation (``continuation=True``, the default): an engine with ``open_session()`` (the
  builtin engine: ``hybridrl.rollout.builtin.session``) is called through one session per
  ``run``, each sequence keyed by its index, so a sequence's next turn prefills only its
  last sampled token, the tool segment and template tokens on top of its kept K/V; a
  sequence's K/V is dropped as soon as it ends, and all of it when ``run`` returns. The
  tails, log-probs and calls are those of resending whole contexts (log-probs up to matmul
  rounding). Engines without it (SGLang: its radix cache reuses the prefix by itself) get
  ``generate`` with the whole contexts; ``continuation=False`` does that for any engine.
- After a turn, a sequence ends (``ended_<reason>`` in the stats) when its turn was cut by a
  budget (``budget``), ended without a tool call (``answer``), it has had
  ``budgets.max_assistant_turns`` turns (``turns``) or ``budgets.max_tool_calls`` calls
  (``tool_calls``), or its tool segment does not fit in what is left of the budget with one
  token for the model (``budget``). Otherwise its calls run (``tools.call``: a failing,
  hanging or huge tool is output text, ``hybridrl.tools.base``), the segment is appended
  (loss mask 0) and it goes on. A call the format cannot parse is an error output too.
- ``share(objects)``: how every rank of one engine's TP group gets the same tool outputs
  (``broadcast_object_list`` from its source; None when one rank drives the engine): tools
  may time out differently on different ranks, the engines' next prompts must not differ.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch

from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists

STAT_KEYS = ("sequences", "with_calls", "turns", "tool_calls", "tool_errors", "tool_timeouts", "model_tokens",
             "tool_tokens", "ended_answer", "ended_budget", "ended_turns", "ended_tool_calls")
_TURN_SEED = 7_919_777


@dataclasses.dataclass(frozen=True)
class Budgets:
    max_tokens: int  # the whole tail after the prompt (rollout.response_length)
    max_tokens_per_turn: int = 0  # 0: no limit of its own
    max_assistant_turns: int = 4
    max_tool_calls: int = 4
    max_parallel_calls: int = 4


@dataclasses.dataclass
class LoopOutput(GenerationOutput):
    loss_mask: torch.Tensor = None  # [B, R] int64: the model's own tokens
    stats: dict = None


@dataclasses.dataclass
class _Seq:
    context: list[int]
    tail: list[int] = dataclasses.field(default_factory=list)
    source: list[int] = dataclasses.field(default_factory=list)  # 1 model, 0 inserted
    logp: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    calls: int = 0
    done: str = ""


class AgentLoop:
    """Runs the multi-turn rollouts of one batch (see the module docstring)."""

    def __init__(self, engine, fmt, tools, budgets: Budgets, share=None,
                 continuation: bool = True) -> None:
        self.engine, self.fmt, self.tools, self.budgets = engine, fmt, tools, budgets
        self.share, self.continuation = share, continuation

    def _session(self):
        """The engine's continuation session, or a null one (no ``open_session``: SGLang)."""
        opener = getattr(self.engine, "open_session", None) if self.continuation else None
        return opener() if opener is not None else _Resend(self.engine)

    def run(self, prompt_ids, params: SamplingParams) -> LoopOutput:
        seqs = [_Seq(list(p)) for p in as_prompt_lists(prompt_ids)]
        stats = dict.fromkeys(STAT_KEYS, 0)
        stats["sequences"] = len(seqs)
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.fmt.stop_ids)))
        with self._session() as session:
            for turn in range(self.budgets.max_assistant_turns):
                live = [i for i, s in enumerate(seqs) if not s.done]
                if not live:
                    break
                allow = {i: self._allowance(seqs[i]) for i in live}
                pending = []  # (sequence, its calls)
                for group in _groups(live, seqs, allow, self._max_len()):
                    out = session.generate([seqs[i].context for i in group], dataclasses.replace(
                        params, max_new_tokens=max(allow[i] for i in group), stop_token_ids=stops,
                        **_turn_seeds(params, group, turn)), group)
                    for b, i in enumerate(group):
                        calls = self._take_turn(seqs[i], out, b, allow[i],
                                                set(params.stop_ids) | set(stops))
                        stats["turns"] += 1
                        if calls is not None:
                            pending.append((i, calls))
                    session.drop([i for i in group if seqs[i].done])  # ended: K/V freed now
                self._run_calls(seqs, pending, stats)
                session.drop([i for i, _ in pending if seqs[i].done])
        for s in seqs:
            s.done = s.done or "turns"
            stats[f"ended_{s.done}"] += 1
            stats["with_calls"] += s.calls > 0
        return self._output(seqs, params.pad_token_id, stats)

    def _max_len(self) -> int | None:
        """Prompt + new tokens of one call, when the engine bounds them together (builtin)."""
        spec = getattr(self.engine, "spec", None)
        return getattr(spec, "max_seq_len", None)

    def _allowance(self, s: _Seq) -> int:
        left = self.budgets.max_tokens - len(s.tail)
        per = self.budgets.max_tokens_per_turn
        return max(1, min(left, per) if per > 0 else left)

    def _take_turn(self, s: _Seq, out, b: int, allow: int, stops: set):
        """Append row ``b`` of ``out`` to ``s``; its tool calls, or None when it ends."""
        n = int(out.response_mask[b].sum())
        ids = out.response_ids[b, :min(n, allow)].tolist()
        logp = out.logprobs[b, :len(ids)].tolist()
        s.tail += ids
        s.context += ids
        s.source += [1] * len(ids)
        s.logp += logp
        s.turns += 1
        if not ids or ids[-1] not in stops:  # cut by a budget: the sequence ends
            s.done = "budget"
            return None
        calls = self.fmt.parse_calls(self.fmt.decode(ids))
        if not calls:
            s.done = "answer"
        elif s.turns >= self.budgets.max_assistant_turns:
            s.done = "turns"
        elif s.calls >= self.budgets.max_tool_calls:
            s.done = "tool_calls"
        else:
            return calls[:self.budgets.max_tool_calls - s.calls]
        return None

    def _run_calls(self, seqs, pending, stats) -> None:
        jobs = [(i, c) for i, calls in pending for c in calls]
        with ThreadPoolExecutor(max(1, self.budgets.max_parallel_calls)) as pool:
            results = list(pool.map(lambda job: self._call(job[1]), jobs))
        if self.share is not None:
            results = self.share(results)
        by_seq = {}
        for (i, _), res in zip(jobs, results):
            by_seq.setdefault(i, []).append(res)
        for i, res in by_seq.items():
            s = seqs[i]
            s.calls += len(res)
            stats["tool_calls"] += len(res)
            stats["tool_errors"] += sum(r.error for r in res)
            stats["tool_timeouts"] += sum(r.timed_out for r in res)
            seg = self.fmt.segment_ids([r.text for r in res])
            if len(s.tail) + len(seg) >= self.budgets.max_tokens:
                s.done = "budget"  # no room for the output and one more model token
                continue
            s.tail += seg
            s.context += seg
            s.source += [0] * len(seg)
            s.logp += [0.0] * len(seg)

    def _call(self, call):
        from hybridrl.tools.base import ToolResult

        if call.problem is not None:
            return ToolResult(f"error: {call.problem}", error=True)
        return self.tools.call(call.name, call.arguments)

    @staticmethod
    def _output(seqs, pad: int, stats: dict) -> LoopOutput:
        R = max(1, max(len(s.tail) for s in seqs))
        ids = torch.full((len(seqs), R), pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), R, dtype=torch.long)
        logp = torch.zeros(len(seqs), R, dtype=torch.float32)
        lmask = torch.zeros(len(seqs), R, dtype=torch.long)
        for i, s in enumerate(seqs):
            n = len(s.tail)
            ids[i, :n] = torch.tensor(s.tail, dtype=torch.long)
            mask[i, :n] = 1
            logp[i, :n] = torch.tensor(s.logp, dtype=torch.float32)
            lmask[i, :n] = torch.tensor(s.source, dtype=torch.long)
            stats["model_tokens"] += sum(s.source)
            stats["tool_tokens"] += n - sum(s.source)
        return LoopOutput(ids, mask, logp, loss_mask=lmask, stats=stats)


class _Resend:
    """The session of an engine without continuation: every call sends whole contexts."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, prompt_ids, params: SamplingParams, keys) -> GenerationOutput:
        return self.engine.generate(prompt_ids, params)

    def drop(self, keys) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _groups(live: list[int], seqs, allow: dict, max_len: int | None) -> list[list[int]]:
    """``live`` in engine calls whose longest context + largest allowance fit ``max_len`` (one
    call when it is None or everything fits; longest contexts first, the same on every rank)."""
    if max_len is None:
        return [live]
    order = sorted(live, key=lambda i: (-len(seqs[i].context), i))
    groups, top, most = [], 0, 0
    for i in order:
        if groups and top + max(most, allow[i]) <= max_len:
            groups[-1].append(i)
            most = max(most, allow[i])
        else:
            groups.append([i])
            top, most = len(seqs[i].context), allow[i]
    return [sorted(g) for g in groups]


def _turn_seeds(params: SamplingParams, live: list[int], turn: int) -> dict:
    """Turn ``turn``'s seeds for rows ``live`` (turn 0: the given ones)."""
    if params.row_seeds is not None:
        return {"row_seeds": tuple((int(params.row_seeds[i]) + turn * _TURN_SEED) % (1 << 62)
                                   for i in live)}
    return {"seed": (int(params.seed) + turn * _TURN_SEED) % (1 << 62)}
