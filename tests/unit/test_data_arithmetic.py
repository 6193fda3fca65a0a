"""Synthetic addition task: rows, disjoint splits, CLI, and the rows score 1.0 on their answer."""

import subprocess
import sys

import pytest

from hybridrl.data.arithmetic import DATA_SOURCE, main, make_rows, write_dataset
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.schema import read_rows
from hybridrl.data.tokenizer import CharTokenizer
from hybridrl.rewards import RewardScorer


def test_rows_state_the_problem_and_its_sum():
    rows = make_rows(50, seed=3, max_digits=3)
    for r in rows:
        a, b = r.extra_info["a"], r.extra_info["b"]
        assert r.messages[0]["content"].startswith(f"What is {a} + {b}?")
        assert r.ground_truth == str(a + b) and 0 <= a < 1000 and 0 <= b < 1000
        assert r.data_source == DATA_SOURCE and "####" in r.messages[0]["content"]
    assert len({(r.extra_info["a"], r.extra_info["b"]) for r in rows}) == 50
    assert [r.ground_truth for r in make_rows(50, seed=3, max_digits=3)] == [
        r.ground_truth for r in rows
    ]
    with pytest.raises(ValueError, match="distinct"):
        make_rows(101, seed=0, max_digits=1)  # only 10 * 10 pairs exist


def test_write_dataset_disjoint_and_scored(tmp_path):
    train, test = write_dataset(str(tmp_path), n_train=80, n_test=20, seed=5, max_digits=1)
    tr, te = read_rows(train), read_rows(test)
    pairs = lambda rows: {(r.extra_info["a"], r.extra_info["b"]) for r in rows}  # noqa: E731
    assert len(tr) == 80 and len(te) == 20 and not pairs(tr) & pairs(te)
    assert {r.extra_info["split"] for r in te} == {"test"}
    ds = PromptDataset(train, CharTokenizer(), max_prompt_length=128)
    assert len(ds) == 80
    good = [f"so the sum is\n#### {r.ground_truth}" for r in tr]
    wrong = [f"#### {int(r.ground_truth) + 1}" for r in tr]
    scorer = RewardScorer()
    ok, _ = scorer.score_batch(good, [r.ground_truth for r in tr], [r.data_source for r in tr])
    bad, _ = scorer.score_batch(wrong, [r.ground_truth for r in tr], [r.data_source for r in tr])
    assert ok.tolist() == [1.0] * 80 and bad.tolist() == [0.0] * 80


def test_cli(tmp_path):
    main(["--out", str(tmp_path / "a"), "--n-train", "5", "--n-test", "2", "--seed", "1"])
    assert len(read_rows(str(tmp_path / "a" / "train.parquet"))) == 5
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrl.data.arithmetic",
            "--out",
            str(tmp_path / "b"),
            "--n-train",
            "5",
            "--n-test",
            "2",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "test.parquet" in out.stdout
    assert read_rows(str(tmp_path / "b" / "train.parquet")) == read_rows(
        str(tmp_path / "a" / "train.parquet")
    )
