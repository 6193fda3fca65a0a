"""Prompt rows as Python objects (issue 42 item 4): every accepted container gives the rows a
verl parquet file gives, the dataset and loaders built from them equal the parquet route's, and
a malformed row is one line naming the row and the field."""

from __future__ import annotations

import dataclasses

import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.config import load_config
from hybridrl.data.arithmetic import make_rows
from hybridrl.data.build import build_loaders
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.records import rows_from_records
from hybridrl.data.schema import read_rows, write_rows
from hybridrl.data.tokenizer import CharTokenizer


def _as_dict(row) -> dict:
    return {"data_source": row.data_source, "prompt": row.messages, "ability": row.ability,
            "reward_model": {"style": row.reward_style, "ground_truth": row.ground_truth},
            "extra_info": row.extra_info}


class MapStyle(torch.utils.data.Dataset):
    """A torch map-style dataset of verl rows (no __iter__: indexed by range(len))."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        if i >= len(self.records):
            raise AssertionError("read past the end")  # a torch Dataset need not raise IndexError
        return self.records[i]


@pytest.fixture
def parquet(tmp_path):
    rows = make_rows(12, seed=3, max_digits=1)
    path = write_rows(str(tmp_path / "train.parquet"), rows)
    return path, read_rows(path)


def test_every_container_gives_the_parquet_rows(parquet):
    path, want = parquet
    records = [_as_dict(r) for r in want]
    table = pq.read_table(path)
    columns = {k: [r[k] for r in records] for k in records[0]}
    for data in (want, records, tuple(records), (r for r in records), MapStyle(records), table,
                 columns):
        assert rows_from_records(data) == want, type(data).__name__


def test_string_prompt_and_numpy_values_are_plain_python():
    import numpy as np

    rows = rows_from_records([{"data_source": "s", "prompt": "2+2?",
                               "reward_model": {"ground_truth": np.int64(4)},
                               "extra_info": {"index": np.int64(0), "tags": np.array([1, 2])}}])
    assert rows[0].messages == [{"role": "user", "content": "2+2?"}]
    assert type(rows[0].ground_truth) is int and rows[0].extra_info == {"index": 0, "tags": [1, 2]}


def test_dataset_and_loaders_from_rows_equal_the_parquet_route(parquet, tmp_path):
    path, rows = parquet
    tok = CharTokenizer()
    a, b = PromptDataset(path, tok, 90), PromptDataset.from_rows(rows, tok, 90)
    assert [e.prompt_ids for e in a.examples] == [e.prompt_ids for e in b.examples]
    assert [e.row for e in a.examples] == [e.row for e in b.examples]
    assert a.digest() == b.digest()
    other = dataclasses.replace(rows[0], ground_truth="wrong")
    assert PromptDataset.from_rows([other, *rows[1:]], tok, 90).digest() != a.digest()
    assert PromptDataset.from_rows(rows[::-1], tok, 90).digest() != a.digest()

    base = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "data.val_batch_size=5",
            "data.max_prompt_length=90", "rollout.response_length=4"]
    files = load_config([], [*base, f"data.train_files=[{path}]", f"data.val_files=[{path}]"])
    mem = load_config([], base)
    (ft, fv), (mt, mv) = build_loaders(files.data, tok), build_loaders(mem.data, tok, rows, rows)
    for _ in range(5):  # past one epoch (12 rows / 4): same seeded order
        x, y = ft.next_batch(), mt.next_batch()
        assert x.prompt_ids == y.prompt_ids and x.ground_truth == y.ground_truth
    assert [b.prompt_ids for b in fv] == [b.prompt_ids for b in mv]
    train_only = build_loaders(mem.data, tok, rows)
    assert train_only[1] is None  # no synthetic validation set stands in for in-memory data
    with pytest.raises(ValueError, match=r"training prompts given twice: train_data \(12 rows\)"):
        build_loaders(files.data, tok, rows)


@pytest.mark.parametrize("data, line", [
    ("prompts.parquet", "train_data: got str; allowed: an iterable of prompt rows"),
    ([], "train_data: no rows; allowed: one or more prompt rows"),
    ([{"data_source": "s", "prompt": "q"}],
     "train_data row 0: 'reward_model' is missing; fields present: ['data_source', 'prompt']"),
    ([{"data_source": "s", "prompt": "q", "reward_model": {"ground_truth": 1}},
      {"data_source": "", "prompt": "q", "reward_model": {"ground_truth": 1}}],
     "train_data row 1: 'data_source' is ''; allowed: a non-empty string"),
    ([{"data_source": "s", "prompt": [{"role": "user"}], "reward_model": {"ground_truth": 1}}],
     "train_data row 0: 'prompt' message 0 is {'role': 'user'}; allowed:"),
    ([{"data_source": "s", "prompt": [], "reward_model": {"ground_truth": 1}}],
     "train_data row 0: 'prompt' is list []; allowed: a non-empty list"),
    ([{"data_source": "s", "prompt": "q", "reward_model": 1}],
     "train_data row 0: 'reward_model' is 1; allowed: a mapping with 'ground_truth'"),
    ([("s", "q", 1)], "train_data row 0: got tuple; allowed: a PromptRow or a mapping"),
    ({"data_source": ["s"], "prompt": "q"}, "train_data: a mapping is read as columns"),
])
def test_malformed_data_is_one_line_naming_row_and_field(data, line):
    with pytest.raises(ValueError) as info:
        rows_from_records(data)
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)
