"""Prompt dataset over verl-schema parquet files: tokenized prompts + what the reward needs.

Contract. ``PromptDataset(files, tokenizer, max_prompt_length, truncation)`` reads every file with
:func:`hybridrl.data.schema.read_rows`, renders each prompt through the tokenizer's chat template
(:func:`hybridrl.data.tokenizer.encode_prompt`) and applies ``max_prompt_length``:

    truncation = "error"  a longer prompt raises ValueError naming the file, row and lengths
               = "left"   keep the last max_prompt_length tokens (the end holds the question and
                          the generation prompt); counted in stats["n_truncated"]
               = "drop"   leave the row out; counted in stats["n_dropped"]

``PromptDataset.from_rows(rows, tokenizer, max_prompt_length, truncation, source)`` does the same
for rows already in memory (``hybridrl.data.records.rows_from_records``; errors name ``source``
and the row instead of a file). ``digest()``: a sha256 of every kept row and its token ids, in
order (two ranks hold the same prompts exactly when their digests agree).

``stats`` = {n_rows, n_kept, n_truncated, n_dropped}, also logged once. ``dataset[i]`` is a
:class:`PromptExample`; ``collate(examples, pad_token_id)`` builds a :class:`PromptBatch` whose
``input_ids`` are left-padded to the longest prompt (``[B, T]``, mask 1 on real tokens), which is
what generation engines expect. Order, shuffling and resume live in :mod:`hybridrl.data.loader`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.data.records import rows_digest
from hybridrl.data.schema import PromptRow, read_rows
from hybridrl.data.tokenizer import encode_prompt

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "drop")


@dataclass
class PromptExample:
    """One tokenized prompt and its row; ``index`` is its position in the dataset."""

    index: int
    prompt_ids: list[int]
    row: PromptRow
    source_file: str


@dataclass
class PromptBatch:
    """A batch of prompts. ``input_ids``/``attention_mask``: [B, T] left-padded."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64, 1 on prompt tokens
    prompt_ids: list[list[int]]  # unpadded
    messages: list[list[dict[str, str]]]
    ground_truth: list[Any]
    data_source: list[str]
    extra_info: list[dict[str, Any]]
    ability: list[str]
    index: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def collate(examples: list[PromptExample], pad_token_id: int) -> PromptBatch:
    """Left-pad the prompts of ``examples`` into one :class:`PromptBatch`."""
    if not examples:
        raise ValueError("collate: examples is empty; allowed: at least one example")
    width = max(len(e.prompt_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.prompt_ids)
        input_ids[b, width - n :] = torch.tensor(e.prompt_ids, dtype=torch.long)
        mask[b, width - n :] = 1
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=mask,
        prompt_ids=[list(e.prompt_ids) for e in examples],
        messages=[e.row.messages for e in examples],
        ground_truth=[e.row.ground_truth for e in examples],
        data_source=[e.row.data_source for e in examples],
        extra_info=[e.row.extra_info for e in examples],
        ability=[e.row.ability for e in examples],
        index=[e.index for e in examples],
    )


class PromptDataset:
    """Tokenized prompts of one or more verl-schema parquet files (see module docstring)."""

    def __init__(
        self,
        files: str | list[str],
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        prompt_key: str = "prompt",
    ) -> None:
        files = [files] if isinstance(files, str) else list(files)
        self._start(tokenizer, max_prompt_length, truncation)
        if not files:
            raise ValueError("data files: empty list; allowed: one or more parquet paths")
        for path in files:
            self._add_rows(read_rows(path, prompt_key), path, prompt_key)
        self._finish(files)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[PromptRow],
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        source: str = "train_data",
    ) -> PromptDataset:
        """The dataset of ``rows`` (in memory), tokenized as the parquet rows would be."""
        self = cls.__new__(cls)
        self._start(tokenizer, max_prompt_length, truncation)
        self._add_rows(rows, source, "prompt")
        self._finish(source)
        return self

    def _start(self, tokenizer, max_prompt_length: int, truncation: str) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={truncation!r} is not supported; allowed: {TRUNCATION_MODES}"
            )
        if int(max_prompt_length) < 1:
            raise ValueError(f"data.max_prompt_length={max_prompt_length}; allowed: >= 1")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.truncation = truncation
        self.examples: list[PromptExample] = []
        self.stats = {"n_rows": 0, "n_kept": 0, "n_truncated": 0, "n_dropped": 0}

    def _finish(self, where) -> None:
        if not self.examples:
            raise ValueError(
                f"{where}: every prompt is longer than max_prompt_length={self.max_prompt_length} "
                "and truncation='drop' left nothing"
            )
        logger.info(
            "prompt dataset %s: %d rows, %d kept, %d truncated (left), %d dropped (> %d tokens)",
            where,
            self.stats["n_rows"],
            self.stats["n_kept"],
            self.stats["n_truncated"],
            self.stats["n_dropped"],
            self.max_prompt_length,
        )

    def _add_rows(self, rows: Sequence[PromptRow], path: str, prompt_key: str) -> None:
        limit = self.max_prompt_length
        for row_idx, row in enumerate(rows):
            self.stats["n_rows"] += 1
            ids = encode_prompt(self.tokenizer, row.messages)
            if len(ids) > limit:
                if self.truncation == "error":
                    raise ValueError(
                        f"{path}: row {row_idx} column '{prompt_key}' has {len(ids)} tokens > "
                        f"data.max_prompt_length={limit}; raise the limit or set "
                        "data.truncation to 'left' or 'drop'"
                    )
                if self.truncation == "drop":
                    self.stats["n_dropped"] += 1
                    continue
                ids = ids[-limit:]
                self.stats["n_truncated"] += 1
            self.stats["n_kept"] += 1
            self.examples.append(PromptExample(len(self.examples), ids, row, path))

    def digest(self) -> str:
        """sha256 of the kept rows and their token ids, in order (see the module docstring)."""
        h = hashlib.sha256(rows_digest([e.row for e in self.examples]).encode())
        for e in self.examples:
            h.update(",".join(map(str, e.prompt_ids)).encode() + b"\n")
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)
