"""verl-schema parquet: a GSM8K file as verl's preprocessing writes it loads unchanged; bad files
fail with a ValueError naming the file and the column."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.data.dataset import PromptDataset
from hybridrl.data.schema import PromptRow, read_rows, write_rows
from hybridrl.data.tokenizer import CharTokenizer
from hybridrl.rewards import RewardScorer

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_RAW = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
        "clips altogether in April and May.\n#### 72",
        "72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
        "10",
    ),
    ("A total of 1,200 apples? Give the count.", "They have 1,200 apples.\n#### 1,200", "1200"),
]

# The arrow schema HF `datasets` gives the dicts of verl's examples/data_preprocess/gsm8k.py:
# struct fields in the insertion order of process_fn, strings as `string`, the row index as int64,
# plus the `huggingface` features metadata datasets stores in the file.
GSM8K_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ],
    metadata={
        b"huggingface": json.dumps(
            {
                "info": {
                    "features": {
                        "data_source": {"dtype": "string", "_type": "Value"},
                        "prompt": {
                            "feature": {
                                "role": {"dtype": "string", "_type": "Value"},
                                "content": {"dtype": "string", "_type": "Value"},
                            },
                            "_type": "List",
                        },
                        "ability": {"dtype": "string", "_type": "Value"},
                    }
                }
            }
        ).encode()
    },
)


def write_verl_gsm8k(path, split="train"):
    rows = []
    for idx, (question, answer, solution) in enumerate(GSM8K_RAW):
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {
                    "split": split,
                    "index": idx,
                    "answer": answer,
                    "question": question,
                },
            }
        )
    pq.write_table(pa.Table.from_pylist(rows, schema=GSM8K_SCHEMA), path)
    return str(path)


def test_verl_gsm8k_parquet_loads_unchanged(tmp_path):
    path = write_verl_gsm8k(tmp_path / "train.parquet")
    assert pq.read_schema(path).remove_metadata().equals(GSM8K_SCHEMA.remove_metadata())
    rows = read_rows(path)
    assert [r.ground_truth for r in rows] == ["72", "10", "1200"]
    assert rows[1].data_source == "openai/gsm8k" and rows[1].ability == "math"
    assert rows[1].extra_info == {
        "split": "train",
        "index": 1,
        "answer": GSM8K_RAW[1][1],
        "question": GSM8K_RAW[1][0],
    }
    assert rows[0].messages == [{"role": "user", "content": GSM8K_RAW[0][0] + " " + INSTRUCTION}]

    tok = CharTokenizer()
    ds = PromptDataset(path, tok, max_prompt_length=1024)
    # the char tokenizer's template: "user: <content>\nassistant: " (one id per character)
    expected = "user: " + GSM8K_RAW[2][0] + " " + INSTRUCTION + "\nassistant: "
    assert tok.decode(ds[2].prompt_ids) == expected and len(ds[2].prompt_ids) == len(expected)

    # the answers of the GSM8K solutions score 1.0 with the registry's strict gsm8k function
    scores, _ = RewardScorer().score_batch(
        [a for _, a, _ in GSM8K_RAW], [r.ground_truth for r in rows], [r.data_source for r in rows]
    )
    assert scores.tolist() == [1.0, 1.0, 1.0]


def test_write_rows_round_trip(tmp_path):
    rows = [
        PromptRow(
            "src/a",
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}],
            "7",
            "math",
            "rule",
            {"split": "test", "index": 0},
        ),
        PromptRow(
            "src/b",
            [{"role": "user", "content": "x"}],
            "8",
            "math",
            "rule",
            {"split": "test", "index": 1},
        ),
    ]
    path = write_rows(str(tmp_path / "sub" / "d.parquet"), rows)
    assert read_rows(path) == rows


def _table_without(column):
    data = {
        "data_source": ["s"],
        "prompt": [[{"role": "user", "content": "q"}]],
        "reward_model": [{"style": "rule", "ground_truth": "1"}],
        "extra_info": [{"split": "train", "index": 0}],
    }
    data.pop(column, None)
    return pa.table(data)


@pytest.mark.parametrize("column", ["data_source", "prompt", "reward_model"])
def test_missing_column_names_file_and_column(tmp_path, column):
    path = str(tmp_path / "missing.parquet")
    pq.write_table(_table_without(column), path)
    with pytest.raises(ValueError, match=rf"missing\.parquet.*'{column}'.*missing"):
        read_rows(path)


@pytest.mark.parametrize(
    "column,values",
    [
        ("prompt", pa.array([3], pa.int64())),
        ("prompt", pa.array([[1, 2]], pa.list_(pa.int64()))),
        ("reward_model", pa.array(["1"], pa.string())),
        ("data_source", pa.array([1.5], pa.float64())),
        ("extra_info", pa.array(["x"], pa.string())),
    ],
)
def test_wrong_type_names_file_and_column(tmp_path, column, values):
    table = _table_without("none")
    table = table.set_column(table.column_names.index(column), column, values)
    path = str(tmp_path / "wrongtype.parquet")
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=rf"wrongtype\.parquet.*'{column}'.*type"):
        read_rows(path)


def test_empty_and_garbage_files_name_the_file(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.parquet.*empty"):
        read_rows(str(empty))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("data_source,prompt\nx,y\n")
    with pytest.raises(ValueError, match=r"garbage\.parquet.*not a readable parquet"):
        read_rows(str(garbage))
    no_rows = str(tmp_path / "norows.parquet")
    pq.write_table(_table_without("none").slice(0, 0), no_rows)
    with pytest.raises(ValueError, match=r"norows\.parquet.*no rows"):
        read_rows(no_rows)


def test_non_utf8_binary_column_names_file_and_column(tmp_path):
    table = _table_without("none")
    bad = pa.array([b"gsm\xff\xfe8k"], pa.binary())
    table = table.set_column(table.column_names.index("data_source"), "data_source", bad)
    path = str(tmp_path / "latin.parquet")
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"latin\.parquet.*'data_source'.*UTF-8"):
        read_rows(path)
    # valid UTF-8 bytes are accepted and decoded
    ok = pa.array(["gsm8k-é".encode()], pa.binary())
    table = table.set_column(table.column_names.index("data_source"), "data_source", ok)
    pq.write_table(table, path)
    assert read_rows(path)[0].data_source == "gsm8k-é"


def test_non_utf8_inside_string_prompt_names_file_and_column(tmp_path):
    # a `string` column whose bytes are not UTF-8 (writers that skip validation can produce it)
    content = b"caf\xe9"
    offsets = pa.py_buffer(bytes([0, 0, 0, 0]) + len(content).to_bytes(4, "little"))
    strings = pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(content)])
    roles = pa.array(["user"])
    struct = pa.StructArray.from_arrays([roles, strings], names=["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), struct)
    table = _table_without("none")
    table = table.set_column(table.column_names.index("prompt"), "prompt", prompt)
    path = str(tmp_path / "badbytes.parquet")
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"badbytes\.parquet.*'prompt'.*UTF-8"):
        read_rows(path)


def test_write_rows_rejects_mixed_types(tmp_path):
    rows = [
        PromptRow("s", [{"role": "user", "content": "q"}], "7"),
        PromptRow("s", [{"role": "user", "content": "q"}], 7),
    ]
    with pytest.raises(ValueError, match=r"mixed\.parquet: rows do not share"):
        write_rows(str(tmp_path / "mixed.parquet"), rows)
