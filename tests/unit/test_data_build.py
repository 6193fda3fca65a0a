"""Tokenizer and loaders built from the config sections (synthetic task and parquet files)."""

import pytest

from hybridrl.data.build import build_loaders, build_tokenizer, resolve_files
from hybridrl.data.tokenizer import CharTokenizer

config = pytest.importorskip("hybridrl.config")


def test_synthetic_task_when_no_files(tmp_path):
    syn = config.SyntheticDataConfig(train_size=20, val_size=5, dir=str(tmp_path / "gen"))
    data = config.DataConfig(train_batch_size=8, val_batch_size=4, synthetic=syn, seed=3)
    tok = build_tokenizer(config.ModelConfig())
    assert isinstance(tok, CharTokenizer)
    train, val = build_loaders(data, tok)
    assert len(train.dataset) == 20 and len(train) == 2  # 20 // 8, last partial batch dropped
    assert len(val.dataset) == 5 and [len(b) for b in val] == [4, 1]
    assert train.next_batch().data_source == ["hybridrl/arithmetic"] * 8


def test_configured_files_and_truncation(tmp_path):
    from hybridrl.data.arithmetic import write_dataset

    train_path, test_path = write_dataset(str(tmp_path), 12, 3, seed=0)
    data = config.DataConfig(
        train_files=[train_path], max_prompt_length=20, truncation="left", train_batch_size=4
    )
    assert resolve_files(data) == ([train_path], [])
    train, val = build_loaders(data, CharTokenizer())
    assert val is None and train.dataset.stats["n_truncated"] == 12  # every prompt is > 20 chars
    assert all(len(e.prompt_ids) == 20 for e in train.dataset.examples)
