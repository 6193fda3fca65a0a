"""Multi-turn rollouts (hybridrl/rollout/multi_turn): the loss mask covers exactly the model's
tokens over random turn structures (the loop's own record and the mask read back from the ids
agree), budgets and turn limits hold, tool output cannot pose as the model, a tool-arithmetic
transcript is what the loop builds, seeds per turn keep a sequence independent of its batch."""

from __future__ import annotations

import random

import torch

from hybridrl.data.tokenizer import CharTokenizer
from hybridrl.data.tool_arithmetic import transcript
from hybridrl.rollout.base import GenerationOutput, SamplingParams
from hybridrl.rollout.multi_turn import AgentLoop, Budgets, build_format, loss_mask
from hybridrl.tools import ToolRegistry, build_tools

TOK = CharTokenizer()


class _Junk:
    """A tool whose output tries everything: the call marker, the resume text, newlines."""

    name, description, in_process, timeout_s = "junk", "junk", True, 1.0
    parameters = {"type": "object", "required": ["arg"], "properties": {"arg": {"type": "string"}}}

    def __init__(self, rng):
        self.rng = rng

    def call(self, arguments):
        parts = [">", "assistant: ", "\nassistant: ", "\n", "<junk x>", "tool: ", "abc", "9"]
        return "".join(self.rng.choice(parts) for _ in range(self.rng.randint(0, 6)))


class _ScriptEngine:
    """Random turns: free text, a valid or broken call ending in '>', an eos, or no stop at all
    (the turn runs into max_new_tokens). Each emitted token gets a unique negative log-prob."""

    def __init__(self, rng):
        self.rng, self.counter, self.calls = rng, 0, 0

    def generate(self, prompts, params: SamplingParams) -> GenerationOutput:
        self.calls += 1
        rows = []
        for _ in prompts:
            text = "".join(self.rng.choice("abc 12+") for _ in range(self.rng.randint(0, 6)))
            end = self.rng.choice(["call", "broken", "eos", "none"])
            ids = TOK.encode(text + {"call": "<junk q>", "broken": "oops>"}.get(end, ""))
            if end == "eos":
                ids.append(TOK.eos_token_id)
            elif end == "none":
                ids += TOK.encode("z" * params.max_new_tokens)
            ids = ids[:params.max_new_tokens] or TOK.encode("z")
            for j, t in enumerate(ids):  # an engine stops at the first stop id
                if t in params.stop_ids:
                    ids = ids[:j + 1]
                    break
            rows.append(ids)
        R = max(len(r) for r in rows)
        out = GenerationOutput(torch.zeros(len(rows), R, dtype=torch.long),
                               torch.zeros(len(rows), R, dtype=torch.long),
                               torch.zeros(len(rows), R))
        for i, r in enumerate(rows):
            out.response_ids[i, :len(r)] = torch.tensor(r)
            out.response_mask[i, :len(r)] = 1
            out.logprobs[i, :len(r)] = -torch.arange(self.counter + 1, self.counter + 1 + len(r),
                                                     dtype=torch.float32)
            self.counter += len(r)
        return out


def _params(B, max_new=64):
    return SamplingParams(max_new, eos_token_id=TOK.eos_token_id, pad_token_id=0,
                          row_seeds=tuple(range(B)))


def test_loss_mask_is_exactly_the_model_tokens_over_random_turn_structures():
    seen = {"segments": 0, "cut": 0, "errors": 0}
    for seed in range(300):
        rng = random.Random(seed)
        tools = ToolRegistry([_Junk(rng)], max_output_chars=rng.choice([3, 40]))
        fmt = build_format("plain", TOK, tools.schemas())
        budgets = Budgets(max_tokens=rng.randint(8, 60), max_tokens_per_turn=rng.choice([0, 5, 12]),
                          max_assistant_turns=rng.randint(1, 5), max_tool_calls=rng.randint(0, 4))
        B = rng.randint(1, 5)
        out = AgentLoop(_ScriptEngine(rng), fmt, tools, budgets).run(
            [[4 + i] for i in range(B)], _params(B))
        model = (out.logprobs != 0).long()  # every token the engine sampled, and only those
        assert torch.equal(out.loss_mask, model), seed
        assert torch.equal(loss_mask(fmt, out.response_ids, out.response_mask), model), seed
        assert torch.equal(out.response_mask.sum(-1) > 0, torch.ones(B, dtype=torch.bool))
        assert out.response_ids.shape[1] <= budgets.max_tokens
        assert int(out.stats["turns"]) <= B * budgets.max_assistant_turns
        assert int(out.stats["tool_calls"]) <= B * budgets.max_tool_calls
        assert int(out.stats["model_tokens"]) == int(model.sum())
        assert int(out.stats["tool_tokens"]) == int((out.response_mask - model).sum())
        assert sum(int(out.stats[f"ended_{r}"]) for r in ("answer", "budget", "turns",
                                                          "tool_calls")) == B
        seen["segments"] += int(out.stats["tool_tokens"] > 0)
        seen["cut"] += int(out.stats["ended_budget"] > 0)
        seen["errors"] += int(out.stats["tool_errors"] > 0)
    assert min(seen.values()) > 20, seen  # the structures the test meant to cover occurred


def test_tool_output_cannot_hand_the_turn_back_early():
    fmt = build_format("plain", TOK, ToolRegistry([_Junk(random.Random(0))]).schemas())
    seg = fmt.segment_ids(["x\nassistant: y>\nassistant: "])
    text = TOK.decode(seg)
    assert text.endswith("\nassistant: ") and text.count("assistant:") == 1
    ids = torch.tensor([TOK.encode("<junk a>") + seg + TOK.encode("ok")])
    assert loss_mask(fmt, ids, torch.ones_like(ids)).tolist() == [
        [1] * 8 + [0] * len(seg) + [1, 1]]


class _Replay:
    """An engine that writes a given transcript's model turns (the tool demo's SFT text)."""

    def __init__(self, turns):
        self.turns = [TOK.encode(t) + ([] if t.endswith(">") else [TOK.eos_token_id])
                      for t in turns]

    def generate(self, prompts, params):
        ids = self.turns.pop(0)
        out = GenerationOutput(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                               torch.full((1, len(ids)), -0.5))
        return out


def test_the_tool_demo_transcript_is_what_the_loop_builds():
    tools = build_tools(["calculator"])
    fmt = build_format("auto", TOK, tools.schemas())
    first, answer = "<calculator 482+735>", "#### 1217"
    engine = _Replay([first, answer])
    out = AgentLoop(engine, fmt, tools, Budgets(max_tokens=64)).run(
        [TOK.encode("user: q\nassistant: ")], _params(1))
    n = int(out.response_mask.sum())
    assert TOK.decode(out.response_ids[0, :n]) == transcript(482, 735, True)
    assert out.loss_mask[0, :n].tolist() == [1] * len(first) + [0] * (
        n - len(first) - len(answer) - 1) + [1] * (len(answer) + 1)  # the eos is the model's
    assert out.stats["tool_calls"] == 1 and out.stats["ended_answer"] == 1


def test_turn_seeds_keep_a_sequence_independent_of_its_batch():
    seen = []

    class _Seeds:
        def generate(self, prompts, params):
            seen.append(params.row_seeds)
            ids = torch.tensor([TOK.encode("<calculator 1+1>")] * len(prompts))
            return GenerationOutput(ids, torch.ones_like(ids), torch.zeros(ids.shape))

    tools = build_tools(["calculator"])
    fmt = build_format("plain", TOK, tools.schemas())
    AgentLoop(_Seeds(), fmt, tools, Budgets(200, max_assistant_turns=3)).run(
        [[5], [6]], SamplingParams(64, eos_token_id=2, row_seeds=(11, 12)))
    assert seen[0] == (11, 12)  # turn 0: the single-turn seeds
    assert len(seen) == 3 and len(set(seen)) == 3 and all(len(s) == 2 for s in seen)
