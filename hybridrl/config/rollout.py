"""Rollout section: the generation engine and its sampling parameters.

Contract: ``RolloutConfig`` selects the engine (``builtin`` runs anywhere; ``sglang`` needs a
GPU and the ``gpu`` extra) and the sampling knobs hybridrl itself uses. Engine-specific options
are not mirrored here: ``engine_kwargs`` is passed through to the engine untouched (its keys are
not checked), except three SGLang settings hybridrl must decide for a colocated run (their
defaults live here): ``mem_fraction_static`` (which ``engine_kwargs`` may still override),
``timeout_s`` (how long any rank waits around generation: the engines' answers and the
hand-off after them, bounded everywhere; with ``parallel.placement=split`` also how long the
training ranks wait for a generated batch) and ``deterministic``. The
generation parallel layout lives in ``parallel.gen``.
"""

from dataclasses import dataclass
from typing import Any

from hybridrl.config._fields import (
    check_choice,
    check_non_negative,
    check_positive,
    check_range,
    knob,
    section,
)

ENGINES = ("builtin", "sglang")
MULTI_TURN_FORMATS = ("auto", "plain", "hermes", "llama3_json")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollouts with tools (hybridrl.rollout.multi_turn, docs/rollout.md)."""

    enable: bool = knob(False, "Each sequence alternates model turns and tool outputs until it "
                        "answers or a budget ends it; rollout.response_length bounds the whole "
                        "tail (model tokens, tool outputs, template tokens); the losses see "
                        "the model's tokens only.")
    format: str = knob("auto", "How tool calls and outputs are written: plain (<NAME ARG>, the "
                       "demo's character tokenizer) | hermes (Qwen2.5/Qwen3 <tool_call>) | "
                       "llama3_json (Llama 3.x) | auto (plain for the character tokenizer, "
                       "else from the chat template).")
    tools: list[str] = knob(["calculator"], "Tools: calculator | python (the code sandbox) | "
                            "'package.module:attr' (a tool object, class or factory).")
    max_assistant_turns: int = knob(4, "Most model turns per sequence (>= 1).")
    max_tool_calls: int = knob(4, "Most tool calls per sequence (>= 0).")
    max_tokens_per_turn: int = knob(0, "Most tokens of one model turn (0: what is left of "
                                    "rollout.response_length).")
    tool_timeout_s: float = knob(0.0, "Seconds a tool call may take before it is killed and "
                                 "answered 'error: timed out' (0: each tool's own).")
    max_tool_response_chars: int = knob(2000, "Tool output longer than this is cut (> 0).")
    max_parallel_calls: int = knob(4, "Tool calls of one round run on this many threads.")
    turn_reward_fn: str = knob("", "Per-turn reward hook 'package.module:function' | "
                               "'file.py:function': fn(turns, data_source, ground_truth, "
                               "extra_info) -> one number per assistant turn (or one: the last "
                               "turn's), added at each turn's last token on top of the outcome "
                               "reward. Empty: none.")

    def __post_init__(self) -> None:
        check_choice("rollout.multi_turn.format", self.format, MULTI_TURN_FORMATS)
        check_positive("rollout.multi_turn.max_assistant_turns", self.max_assistant_turns)
        check_non_negative("rollout.multi_turn.max_tool_calls", self.max_tool_calls)
        check_non_negative("rollout.multi_turn.max_tokens_per_turn", self.max_tokens_per_turn)
        check_non_negative("rollout.multi_turn.tool_timeout_s", self.tool_timeout_s)
        check_positive("rollout.multi_turn.max_tool_response_chars", self.max_tool_response_chars)
        check_positive("rollout.multi_turn.max_parallel_calls", self.max_parallel_calls)
        if not isinstance(self.tools, (list, tuple)) or not all(isinstance(t, str) for t in self.tools):
            raise ValueError(f"rollout.multi_turn.tools must be a list of names; got {self.tools!r}")


@dataclass(frozen=True)
class RolloutConfig:
    """Response generation for training and validation."""

    engine: str = knob("builtin", "Generation engine: builtin (pure torch, any device) | sglang.")
    n: int = knob(1, "Responses sampled per prompt (GRPO needs >= 2).")
    response_length: int = knob(512, "Maximum number of generated tokens per response.")
    temperature: float = knob(1.0, "Sampling temperature (0 = greedy).")
    top_p: float = knob(1.0, "Nucleus sampling mass, in (0, 1].")
    top_k: int = knob(-1, "Keep the k most likely tokens; -1 = off.")
    val_temperature: float = knob(0.0, "Sampling temperature for validation (0 = greedy).")
    engine_kwargs: dict[str, Any] = knob({}, "Passed unchanged to the engine's constructor "
                                         "(e.g. sglang's mem_fraction_static).")
    engine_start_timeout_s: float = knob(1800.0, "sglang: seconds every rank waits for all "
                                         "engines to start (model load, CUDA graphs) before "
                                         "failing; separate from the 600 s collective timeout.")
    engine_port_base: int = knob(30000, "sglang: each engine on a node uses ports from "
                                 "engine_port_base + 16 * its first GPU.")
    mem_fraction_static: float = knob(0.5, "sglang: fraction of the whole GPU its weights and KV "
                                      "cache may fill, counted with what training still holds "
                                      "while generating (verl's gpu_memory_utilization, same "
                                      "default); raise it when training offloads (hybridrl "
                                      "plan --memory shows the gen phase). "
                                      "engine_kwargs.mem_fraction_static overrides it.")
    timeout_s: float = knob(3600.0, "Seconds any rank waits around generation before "
                            "failing with a line naming the late engine: a generate call and "
                            "the hand-off after it (every engine; the gen-TP groups' "
                            "collectives too), sglang's weight-push rounds and its flush "
                            "before release (half of it); parallel.placement=split: seconds "
                            "the training ranks wait for a generated batch.")
    async_steps: int = knob(0, "k >= 0. 0: each step generates its batch, then trains on it | "
                            "k >= 1 (needs parallel.placement=split): the generation ranks "
                            "generate up to k batches ahead while the training ranks train (a "
                            "batch is at most k policy versions stale: rollout/staleness_*; "
                            "old log-probs recomputed on the training ranks; actor.rollout_is "
                            "recommended).")
    deterministic: bool = knob(False, "sglang: enable_deterministic_inference (batch-invariant "
                               "kernels, NCCL tree all-reduce, no custom all-reduce; slower). "
                               "The pinned SGLang honours per-request seeds only then.")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "Multi-turn rollouts with tools.")

    def __post_init__(self) -> None:
        check_choice("rollout.engine", self.engine, ENGINES)
        check_positive("rollout.n", self.n)
        check_positive("rollout.response_length", self.response_length)
        check_positive("rollout.engine_start_timeout_s", self.engine_start_timeout_s)
        check_positive("rollout.timeout_s", self.timeout_s)
        if isinstance(self.async_steps, bool) or not isinstance(self.async_steps, int) \
                or self.async_steps < 0:
            raise ValueError(f"rollout.async_steps must be an integer >= 0; got "
                             f"{self.async_steps!r}")
        check_range("rollout.mem_fraction_static", self.mem_fraction_static, 0.0, 1.0,
                    low_open=True)
        check_range("rollout.engine_port_base", self.engine_port_base, 1024, 65535 - 16 * 64)
        check_non_negative("rollout.temperature", self.temperature)
        check_non_negative("rollout.val_temperature", self.val_temperature)
        check_range("rollout.top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1; got {self.top_k!r}")
