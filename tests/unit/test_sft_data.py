"""SFT pairs (hybridrl.data.sft), the synthetic pairs, and the SFT entrypoint's start-up errors."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.data.arithmetic import sft_format_copies, write_sft_dataset
from hybridrl.data.sft import SFTDataset, read_pairs, sft_microbatch
from hybridrl.data.tokenizer import CharTokenizer, encode_prompt


def test_microbatch_masks_exactly_the_response_and_eos(tmp_path):
    tok = CharTokenizer()
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"q": ["What is 1 + 2?", "Hi"], "a": ["#### 3", "12"]}), path)
    data = SFTDataset([path], tok, 64, prompt_key="q", response_key="a")
    prompt = encode_prompt(tok, [{"role": "user", "content": "What is 1 + 2?"}])
    assert data[0].prompt_ids == prompt and data[0].response_ids == tok.encode("#### 3") + [2]
    mb = sft_microbatch([data[0], data[1]], pad_id=0)
    row, n = mb["loss_mask"][0], len(prompt)
    assert row.sum() == len("#### 3") + 1 and row[n - 1] == 1 and row[n - 2] == 0
    labels = mb["labels"][0][row.bool()].tolist()
    assert labels == tok.encode("#### 3") + [tok.eos_token_id]
    assert mb["loss_mask"][1].sum() == 3 and mb["input_ids"].shape == mb["labels"].shape


def test_bad_files_name_the_column_and_row(tmp_path):
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"prompt": ["x"], "answer": ["y"]}), path)
    with pytest.raises(ValueError, match="no column 'response' \\(sft.response_key\\)"):
        read_pairs(path)
    pq.write_table(pa.table({"prompt": ["x" * 50], "response": ["y"]}), path)
    with pytest.raises(ValueError, match="row 0: .* > sft.max_length=20"):
        SFTDataset([path], CharTokenizer(), 20)


def test_synthetic_pairs_follow_the_format_fraction(tmp_path):
    # 0.25 = 1/4: each of the 20 prompts 4 times, exactly one copy with the marker
    path = write_sft_dataset(str(tmp_path), 68, 20, seed=1, max_digits=1, format_fraction=0.25)
    table = pq.read_table(path)
    prompts = [p[0]["content"] for p in table.column("prompt").to_pylist()]
    responses = table.column("response").to_pylist()
    assert len(responses) == 80 and len(set(prompts)) == 20
    marked = [p for p, r in zip(prompts, responses) if r.startswith("#### ")]
    assert sorted(marked) == sorted(set(prompts))
    assert sft_format_copies(0.2) == (1, 5) and sft_format_copies(0.33) == (1, 3)
    for fraction in (0.0, 1.0):
        one = pq.read_table(write_sft_dataset(str(tmp_path), 68, 20, seed=1, max_digits=1,
                                              format_fraction=fraction))
        answers = one.column("response").to_pylist()
        assert len(answers) == 20
        assert all(r.startswith("#### ") == (fraction == 1.0) for r in answers)


def test_sft_entrypoint_unwritable_output_is_one_line(tmp_path, capsys, monkeypatch):
    from hybridrl.sft import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status = main([f"sft.output_dir={blocker}/sub", f"trainer.output_dir={tmp_path}/out",
                   f"data.synthetic.dir={tmp_path}/data", "trainer.device=cpu"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "sft.output_dir" in err
