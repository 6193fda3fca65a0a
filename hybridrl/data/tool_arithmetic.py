"""The tool demo's task: additions too large for the tiny model to do in its head, with the
calculator tool, in the plain multi-turn format (``hybridrl.rollout.multi_turn.format``).

Contract. Prompts, ground truths and the reward are the arithmetic task's
(``hybridrl.data.arithmetic``: "What is a + b? ...", the answer after "####", scored exactly
by ``hybridrl/arithmetic``). ``transcript(a, b, use_tool)`` is the response a model that uses
the tool writes in the plain format: ``<calculator a+b>``, then the segment the agent loop
inserts (``"\\ntool: <a + b>\\nassistant: "``), then ``#### <a + b>``; without the tool it is
``#### <a + b>`` alone. ``write_tool_dataset(out_dir, n_train, n_test, seed, max_digits,
tool_fraction)`` writes ``train.parquet`` / ``test.parquet`` (disjoint problems) and
``sft_train.parquet``: every training problem ``q`` times, ``p`` of them using the tool
(``(p, q)`` = ``tool_fraction`` rounded to a fraction with q <= 10, as
``hybridrl.data.arithmetic.sft_format_copies``), so the SFT model calls the tool with a
prompt-independent probability of about ``p / q``. Returns the three paths.
(The SFT loss covers the inserted tool output too: SFT has no loss mask of its own here.)
"""

from __future__ import annotations

import os

from hybridrl.data.arithmetic import sft_format_copies, write_dataset

PLAIN_TOOL_OUTPUT = "\ntool: {}\nassistant: "  # the plain format's segment, before the model's turn


def transcript(a: int, b: int, use_tool: bool) -> str:
    """The response text of a model that answers a + b with (or without) the calculator."""
    answer = f"#### {a + b}"
    if not use_tool:
        return answer
    return f"<calculator {a}+{b}>" + PLAIN_TOOL_OUTPUT.format(a + b) + answer


def write_tool_dataset(out_dir: str, n_train: int, n_test: int, seed: int = 0,
                       max_digits: int = 3, tool_fraction: float = 0.2) -> tuple[str, str, str]:
    """train / test prompts and the SFT transcripts (see the module docstring)."""
    from hybridrl.data.schema import read_rows
    from hybridrl.data.sft import write_pairs

    train, test = write_dataset(out_dir, n_train, n_test, seed, max_digits)
    uses, copies = sft_format_copies(tool_fraction)
    rows = read_rows(train)
    prompts, responses = [], []
    for k in range(copies):
        for r in rows:
            a, b = int(r.extra_info["a"]), int(r.extra_info["b"])
            prompts.append(r.messages)
            responses.append(transcript(a, b, k < uses))
    sft = write_pairs(os.path.join(out_dir, "sft_train.parquet"), prompts, responses)
    return train, test, sft
