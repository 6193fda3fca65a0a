"""(prompt, response) pairs for supervised fine-tuning, in verl's SFT parquet layout.

Contract:
- ``read_pairs(path, prompt_key, response_key)`` reads one parquet file: ``prompt_key`` holds a
  string (sent as one user message) or a chat list of {role, content}; ``response_key`` a string.
  A missing column or a value of another type raises ``ValueError`` naming the file, the column
  and the row.
- ``SFTDataset(files, tokenizer, max_length, prompt_key, response_key)`` tokenizes each pair as
  the RL run sees it: ``encode_prompt`` (chat template + generation prompt) then the response
  ids and EOS. ``len(prompt_ids) + len(response_ids) + 1 > max_length`` raises naming the row.
- ``sft_microbatch(examples, pad_id)`` (pure) builds one megatron micro-batch: ``input_ids``
  [B, T] right-padded, ``labels`` [B, T] (the next token) and ``loss_mask`` [B, T]: 1 exactly
  where ``labels`` is a response token or the EOS after it.
- ``write_pairs(path, prompts, responses)`` writes the layout (prompts as chat lists).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hybridrl.data.tokenizer import encode_prompt


@dataclass(frozen=True)
class SFTExample:
    """One tokenized pair; ``index`` is its position in the dataset."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]  # the response's ids followed by EOS


def _messages(value, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))}
                for m in value]
    raise ValueError(f"{where}: expected a string or a list of {{role, content}}; "
                     f"got {type(value).__name__}")


def read_pairs(path: str, prompt_key: str = "prompt",
               response_key: str = "response") -> list[tuple[list[dict], str]]:
    """[(messages, response)] of one parquet file (see the module docstring)."""
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow: missing file, not parquet, truncated
        raise ValueError(f"SFT file {path!r} cannot be read as parquet ({err})") from None
    for key, name in ((prompt_key, "sft.prompt_key"), (response_key, "sft.response_key")):
        if key not in table.column_names:
            raise ValueError(f"SFT file {path!r} has no column {key!r} ({name}); columns: "
                             f"{', '.join(table.column_names)}")
    prompts, responses = table.column(prompt_key).to_pylist(), table.column(response_key).to_pylist()
    pairs = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not isinstance(r, str):
            raise ValueError(f"SFT file {path!r} row {i} column {response_key!r}: expected a "
                             f"string; got {type(r).__name__}")
        pairs.append((_messages(p, f"SFT file {path!r} row {i} column {prompt_key!r}"), r))
    return pairs


class SFTDataset:
    """Tokenized pairs of one or more SFT parquet files (see the module docstring)."""

    def __init__(self, files: list[str], tokenizer, max_length: int,
                 prompt_key: str = "prompt", response_key: str = "response"):
        if not files:
            raise ValueError("sft.train_files: empty list; allowed: one or more parquet paths")
        self.examples: list[SFTExample] = []
        eos = int(tokenizer.eos_token_id)
        for path in files:
            for row, (messages, response) in enumerate(read_pairs(path, prompt_key, response_key)):
                prompt_ids = encode_prompt(tokenizer, messages)
                response_ids = [*tokenizer.encode(response, add_special_tokens=False), eos]
                if len(prompt_ids) + len(response_ids) > max_length:
                    raise ValueError(f"SFT file {path!r} row {row}: {len(prompt_ids)} prompt + "
                                     f"{len(response_ids)} response tokens > sft.max_length="
                                     f"{max_length}")
                self.examples.append(SFTExample(len(self.examples), prompt_ids, response_ids))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]


def sft_microbatch(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids / labels / loss_mask [B, T] of ``examples`` (see the module docstring)."""
    width = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    input_ids_BT = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels_BT = torch.zeros_like(input_ids_BT)
    loss_mask_BT = torch.zeros(len(examples), width)
    for b, e in enumerate(examples):
        seq = e.prompt_ids + e.response_ids
        input_ids_BT[b, :len(seq)] = torch.tensor(seq)
        labels_BT[b, :len(seq) - 1] = torch.tensor(seq[1:])
        # position t predicts seq[t + 1]: the response starts at t = len(prompt) - 1
        loss_mask_BT[b, len(e.prompt_ids) - 1:len(seq) - 1] = 1.0
    return {"input_ids": input_ids_BT, "labels": labels_BT, "loss_mask": loss_mask_BT}


def write_pairs(path: str, prompts: list[list[dict]], responses: list[str]) -> str:
    """Write (prompt chat list, response) rows in verl's SFT layout; returns ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    table = pa.table({"prompt": prompts, "response": responses})
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
