"""Synthetic arithmetic task (multi-digit addition) in verl's parquet schema, for the CPU demo.

Contract. ``make_rows(n, seed, split, max_digits)`` returns ``n`` :class:`PromptRow` whose prompt
asks for ``a + b`` with ``0 <= a < 10**max_digits`` and ``0 <= b < 10**second_digits``
(``second_digits`` 0: ``max_digits``) and says to write the answer after "####";
``reward_model.ground_truth`` is ``str(a + b)`` and ``data_source`` is :data:`DATA_SOURCE`, which the
reward registry scores (exact answer, see hybridrl.rewards.arithmetic). ``write_dataset(out_dir,
n_train, n_test, seed)`` writes ``train.parquet`` and ``test.parquet`` with no (a, b) pair shared
between them, and is also the CLI. ``write_sft_dataset(out_dir, n_train, n_sft, seed, max_digits)``
writes ``sft_train.parquet`` in verl's SFT layout (hybridrl.data.sft): the first ``n_sft`` of the
``n_train`` training prompts with the response ``"#### <a + b>"`` (never a test problem). With
``format_fraction`` f < 1, f is rounded to the nearest p/q with q <= 10 and every prompt is
written q times, p of them with the marker and q - p as the bare "<a + b>": the same share for
every prompt, so a model learns a prompt-independent probability p/q of following the format
(not which prompts use it, which would not carry over to unseen prompts):

    python -m hybridrl.data.arithmetic --out DIR --n-train N --n-test N --seed S [--max-digits D]
"""

from __future__ import annotations

import argparse
import os
from fractions import Fraction

import numpy as np

from hybridrl.data.schema import PromptRow, write_rows

DATA_SOURCE = "hybridrl/arithmetic"
INSTRUCTION = 'Write the final answer after "####".'


def _row(a: int, b: int, split: str, index: int) -> PromptRow:
    return PromptRow(
        data_source=DATA_SOURCE,
        messages=[{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}],
        ground_truth=str(a + b),
        ability="math",
        reward_style="rule",
        extra_info={"split": split, "index": index, "a": a, "b": b},
    )


def _sample_pairs(n: int, rng: np.random.Generator, high: int, taken: set,
                  high_b: int | None = None) -> list[tuple[int, int]]:
    """``n`` distinct (a, b) pairs not in ``taken`` (which is updated)."""
    high_b = high_b or high
    if n + len(taken) > high * high_b:
        raise ValueError(
            f"asked for {n} more addition problems but only {high * high_b - len(taken)} distinct "
            f"pairs with operands < {high}, {high_b} remain; raise max_digits"
        )
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        a, b = (int(x) for x in rng.integers(0, (high, high_b), size=2))
        if (a, b) not in taken:
            taken.add((a, b))
            pairs.append((a, b))
    return pairs


def make_rows(
    n: int, seed: int, split: str = "train", max_digits: int = 2, exclude: set | None = None,
    second_digits: int = 0,
) -> list[PromptRow]:
    """``n`` distinct addition problems (a < 10**max_digits, b < 10**(second_digits or
    max_digits)), none of them in ``exclude``."""
    if n < 1:
        raise ValueError(f"n={n}; allowed: >= 1")
    if not 1 <= max_digits <= 9 or not 0 <= second_digits <= 9:
        raise ValueError(f"max_digits={max_digits}, second_digits={second_digits}; allowed: "
                         "1..9 and 0..9")
    taken = set() if exclude is None else exclude
    pairs = _sample_pairs(n, np.random.default_rng(seed), 10**max_digits, taken,
                          10**(second_digits or max_digits))
    return [_row(a, b, split, i) for i, (a, b) in enumerate(pairs)]


def write_dataset(
    out_dir: str, n_train: int, n_test: int, seed: int = 0, max_digits: int = 2,
    second_digits: int = 0,
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` (disjoint problems); returns both paths."""
    taken: set = set()
    train = make_rows(n_train, seed, "train", max_digits, taken, second_digits)
    test = make_rows(n_test, seed + 1, "test", max_digits, taken, second_digits)
    return (
        write_rows(os.path.join(out_dir, "train.parquet"), train),
        write_rows(os.path.join(out_dir, "test.parquet"), test),
    )


def sft_format_copies(format_fraction: float) -> tuple[int, int]:
    """(p, q): ``format_fraction`` rounded to the nearest p/q with q <= 10 (pure)."""
    if not 0.0 <= format_fraction <= 1.0:
        raise ValueError(f"format_fraction={format_fraction}; allowed: 0..1")
    share = Fraction(format_fraction).limit_denominator(10)
    return share.numerator, share.denominator


def write_sft_dataset(out_dir: str, n_train: int, n_sft: int, seed: int = 0,
                      max_digits: int = 2, second_digits: int = 0,
                      format_fraction: float = 1.0) -> str:
    """Write ``sft_train.parquet``: (prompt, "#### <sum>") of the first ``n_sft`` training rows,
    each written q times, p of them with the marker and the others "<sum>" alone
    (``(p, q) = sft_format_copies(format_fraction)``; q = 1 for 0 and 1). Rows are ordered
    copy-major: rows ``k * n_sft .. (k + 1) * n_sft - 1`` are copy k, copies ``0 .. p - 1``
    marked."""
    from hybridrl.data.sft import write_pairs

    if not 1 <= n_sft <= n_train:
        raise ValueError(f"n_sft={n_sft}; allowed: 1..n_train ({n_train})")
    marked, copies = sft_format_copies(format_fraction)
    rows = make_rows(n_train, seed, "train", max_digits, set(), second_digits)[:n_sft]
    prompts = [r.messages for _ in range(copies) for r in rows]
    responses = [("#### " if k < marked else "") + str(r.ground_truth)
                 for k in range(copies) for r in rows]
    return write_pairs(os.path.join(out_dir, "sft_train.parquet"), prompts, responses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--n-test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-digits", type=int, default=2)
    parser.add_argument("--second-digits", type=int, default=0, help="0: --max-digits")
    args = parser.parse_args(argv)
    paths = write_dataset(args.out, args.n_train, args.n_test, args.seed, args.max_digits,
                          args.second_digits)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
