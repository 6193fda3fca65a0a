"""GSM8K's own parquet files -> verl-schema parquet (train.parquet, test.parquet) for hybridrl.

Contract: reads the ``question``/``answer`` rows of GSM8K's "main" parquet files (the files of the
``openai/gsm8k`` dataset repository: ``main/train-00000-of-00001.parquet`` and
``main/test-00000-of-00001.parquet``, copied to a local folder; nothing is downloaded here) and
writes, per split, the rows verl's ``examples/data_preprocess/gsm8k.py`` writes:

    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": the number after "####", commas removed}
    extra_info   {"split": split, "index": row number, "answer": answer, "question": question}

so hybridrl's "openai/gsm8k" reward (strict ``#### N``) scores them. An answer without a
``#### N`` line raises ValueError naming the split and row.

    python examples/prepare_gsm8k.py --src path/to/gsm8k --out data/gsm8k
    python examples/prepare_gsm8k.py --train a.parquet --test b.parquet --out data/gsm8k
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import pyarrow.parquet as pq

from hybridrl.data.schema import PromptRow, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def final_answer(answer: str) -> str | None:
    """The first ``#### N`` number of a GSM8K solution, commas removed; None when absent."""
    match = FINAL_ANSWER.search(answer)
    return None if match is None else match.group(1).replace(",", "")


def to_rows(records: list[dict], split: str) -> list[PromptRow]:
    """verl-schema rows of one split (see the module docstring)."""
    rows = []
    for index, rec in enumerate(records):
        question, answer = rec["question"], rec["answer"]
        truth = final_answer(answer)
        if truth is None:
            raise ValueError(f"{split} row {index}: answer has no '#### N' line: {answer[-80:]!r}")
        rows.append(PromptRow(
            data_source=DATA_SOURCE,
            messages=[{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            ground_truth=truth, ability="math", reward_style="rule",
            extra_info={"split": split, "index": index, "answer": answer, "question": question}))
    return rows


def find_split(src: str, split: str) -> str:
    """``src/main/<split>-*.parquet`` (the dataset repository layout) or ``src/<split>-*.parquet``."""
    for pattern in (os.path.join(src, "main", f"{split}-*.parquet"),
                    os.path.join(src, f"{split}-*.parquet")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise ValueError(f"--src {src!r}: no main/{split}-*.parquet or {split}-*.parquet inside")


def convert(train: str, test: str, out: str) -> dict[str, str]:
    """Write ``out``/train.parquet and ``out``/test.parquet; their paths by split."""
    written = {}
    for split, path in (("train", train), ("test", test)):
        records = pq.read_table(path, columns=["question", "answer"]).to_pylist()
        written[split] = write_rows(os.path.join(out, f"{split}.parquet"), to_rows(records, split))
    return written


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", help="folder holding GSM8K's parquet files (main/ inside)")
    parser.add_argument("--train", help="GSM8K train parquet (instead of --src)")
    parser.add_argument("--test", help="GSM8K test parquet (instead of --src)")
    parser.add_argument("--out", default="data/gsm8k", help="output folder (default data/gsm8k)")
    args = parser.parse_args(argv)
    if bool(args.src) == bool(args.train and args.test):
        parser.error("give either --src DIR or both --train FILE and --test FILE")
    train = args.train or find_split(args.src, "train")
    test = args.test or find_split(args.src, "test")
    written = convert(train, test, args.out)
    for split, path in written.items():
        print(f"{split}: {path}")
    return written


if __name__ == "__main__":
    main()
