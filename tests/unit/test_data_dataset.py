"""PromptDataset (truncation modes, collate) and PromptLoader (seeded order, resume)."""

import numpy as np
import pytest

from hybridrl.data.dataset import PromptDataset, collate
from hybridrl.data.loader import PromptLoader
from hybridrl.data.schema import PromptRow, write_rows
from hybridrl.data.tokenizer import CharTokenizer

# char template: "user: {q}\nassistant: " = 6 + len(q) + 12 characters = len(q) + 18 tokens
OVERHEAD = len("user: ") + len("\nassistant: ")


def _write(path, questions):
    rows = [
        PromptRow(
            "src",
            [{"role": "user", "content": q}],
            str(i),
            "math",
            "rule",
            {"split": "train", "index": i},
        )
        for i, q in enumerate(questions)
    ]
    return write_rows(str(path), rows)


def test_truncation_modes(tmp_path):
    path = _write(tmp_path / "d.parquet", ["a" * 2, "b" * 12, "c" * 5, "d" * 20])
    limit = OVERHEAD + 5  # prompts 1 and 3 are longer (30 and 38 tokens > 23)
    tok = CharTokenizer()
    with pytest.raises(
        ValueError, match=r"d\.parquet: row 1 .*30 tokens > data.max_prompt_length=23"
    ):
        PromptDataset(path, tok, limit, truncation="error")

    dropped = PromptDataset(path, tok, limit, truncation="drop")
    assert dropped.stats == {"n_rows": 4, "n_kept": 2, "n_truncated": 0, "n_dropped": 2}
    assert [e.row.ground_truth for e in dropped.examples] == ["0", "2"]

    left = PromptDataset(path, tok, limit, truncation="left")
    assert left.stats == {"n_rows": 4, "n_kept": 4, "n_truncated": 2, "n_dropped": 0}
    full = tok.encode("user: " + "d" * 20 + "\nassistant: ")
    assert left[3].prompt_ids == full[-limit:]  # keeps the end (question tail + generation prompt)
    # the last 23 characters: 23 - len("\nassistant: ")(12) = 11 of the question's "d"s
    assert tok.decode(left[3].prompt_ids) == "d" * 11 + "\nassistant: "
    assert len(left[3].prompt_ids) == limit and left[0].prompt_ids == tok.encode(
        "user: aa\nassistant: "
    )

    with pytest.raises(ValueError, match="data.truncation='right'.*allowed"):
        PromptDataset(path, tok, limit, truncation="right")
    with pytest.raises(ValueError, match="left nothing"):
        PromptDataset(path, tok, 3, truncation="drop")


def test_collate_left_pads(tmp_path):
    path = _write(tmp_path / "d.parquet", ["1", "123"])
    ds = PromptDataset(path, CharTokenizer(), 64)
    batch = collate([ds[0], ds[1]], pad_token_id=0)
    n0, n1 = len(ds[0].prompt_ids), len(ds[1].prompt_ids)  # 19 and 21
    assert batch.input_ids.shape == (2, n1) and n1 - n0 == 2
    assert batch.attention_mask[0].tolist() == [0, 0] + [1] * n0
    assert batch.input_ids[0, :2].tolist() == [0, 0]
    assert batch.input_ids[0, 2:].tolist() == ds[0].prompt_ids
    assert batch.ground_truth == ["0", "1"] and batch.extra_info[1] == {
        "split": "train",
        "index": 1,
    }
    assert batch.data_source == ["src", "src"] and batch.index == [0, 1]


@pytest.fixture
def ten_prompts(tmp_path):
    path = _write(tmp_path / "d.parquet", [f"q{i}" for i in range(10)])
    return PromptDataset(path, CharTokenizer(), 64)


def test_loader_order_is_seeded_and_covers_each_epoch(ten_prompts):
    a = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=7)
    b = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=7)
    epoch0 = [batch.index for batch in a]
    assert epoch0 == [batch.index for batch in b] and len(epoch0) == len(a) == 3
    flat = sum(epoch0, [])
    assert flat == np.random.default_rng([7, 0]).permutation(10)[:9].tolist()
    assert a.epoch == 1 and a.cursor == 0  # drop_last skipped the 10th prompt
    epoch1 = sum((batch.index for batch in a), [])
    assert epoch1 != flat and len(set(epoch1)) == 9
    c = PromptLoader(ten_prompts, batch_size=3, shuffle=True, seed=8)
    assert sum((x.index for x in c), []) != flat
    plain = PromptLoader(ten_prompts, batch_size=4, shuffle=False, drop_last=False)
    assert [x.index for x in plain] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_loader_resume_continues_exactly(ten_prompts):
    ref = PromptLoader(ten_prompts, batch_size=3, seed=1)
    expected = [ref.next_batch().index for _ in range(8)]  # crosses two epoch boundaries
    for stop in range(8):
        first = PromptLoader(ten_prompts, batch_size=3, seed=1)
        got = [first.next_batch().index for _ in range(stop)]
        state = first.state_dict()
        resumed = PromptLoader(ten_prompts, batch_size=3, seed=1)
        resumed.load_state_dict(dict(state))
        got += [resumed.next_batch().index for _ in range(8 - stop)]
        assert got == expected, stop


def test_loader_refuses_foreign_state(ten_prompts):
    loader = PromptLoader(ten_prompts, batch_size=3, seed=1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="'seed'"):
        PromptLoader(ten_prompts, batch_size=3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="cursor"):
        loader.load_state_dict({**state, "cursor": 10})
    with pytest.raises(ValueError, match="train_batch_size=11"):
        PromptLoader(ten_prompts, batch_size=11)
