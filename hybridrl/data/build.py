"""Build the tokenizer and the prompt loaders from the config sections (``model``, ``data``).

Contract. ``build_tokenizer(model_cfg)`` loads ``model.tokenizer_path``, else ``model.path``, else
the builtin character tokenizer. ``resolve_files(data_cfg)`` returns (train_files, val_files):
the configured parquet files, or, when ``data.train_files`` is empty, the synthetic task's
``train.parquet``/``test.parquet`` written to ``data.synthetic.dir`` (the test split stands in
for validation unless ``data.val_files`` is set). ``build_loaders(data_cfg, tokenizer)`` returns
``(train_loader, val_loader)``: the train loader shuffles with ``data.seed`` and drops the last
partial batch; the validation loader (None without validation files) keeps order and every prompt.
With ``train_rows`` (``PromptRow`` list, in memory: ``hybridrl.data.records``) the training
prompts are those rows instead of files (``data.train_files`` must then be empty: ValueError
otherwise) and nothing is generated; validation then uses ``val_rows`` when given, else
``data.val_files``, else none. ``val_rows`` alone replaces ``data.val_files`` for parquet or
synthetic training data. Either way the loaders are the same seeded ``PromptLoader`` s: every
rank builds the same loaders from the same rows and draws the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.data.arithmetic import write_dataset
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.loader import PromptLoader
from hybridrl.data.schema import PromptRow
from hybridrl.data.tokenizer import load_tokenizer


def build_tokenizer(model_cfg: Any) -> Any:
    """The tokenizer of the ``model`` section (see the module docstring)."""
    return load_tokenizer(model_cfg.tokenizer_path or model_cfg.path or "char")


def resolve_files(data_cfg: Any) -> tuple[list[str], list[str]]:
    """(train_files, val_files): configured, or the synthetic task's (written now)."""
    train, val = list(data_cfg.train_files), list(data_cfg.val_files)
    if train:
        return train, val
    syn = data_cfg.synthetic
    if syn.task != "arithmetic":
        raise ValueError(
            f"data.train_files is empty and data.synthetic.task={syn.task!r}; allowed: "
            "parquet files in data.train_files or data.synthetic.task=arithmetic"
        )
    train_path, test_path = write_dataset(
        syn.dir, syn.train_size, syn.val_size, data_cfg.seed, syn.max_digits, syn.second_digits
    )
    return [train_path], val or [test_path]


def _dataset(files: list[str], tokenizer: Any, data_cfg: Any) -> PromptDataset:
    return PromptDataset(
        files, tokenizer, data_cfg.max_prompt_length, data_cfg.truncation, data_cfg.prompt_key
    )


def build_loaders(
    data_cfg: Any, tokenizer: Any, train_rows: Sequence[PromptRow] | None = None,
    val_rows: Sequence[PromptRow] | None = None,
) -> tuple[PromptLoader, PromptLoader | None]:
    """(train_loader, val_loader or None) from files or rows (see the module docstring)."""
    if train_rows is not None:
        if data_cfg.train_files:
            raise ValueError(
                f"training prompts given twice: train_data ({len(train_rows)} rows) and "
                f"data.train_files={list(data_cfg.train_files)}; give one of them"
            )
        train_set = PromptDataset.from_rows(
            train_rows, tokenizer, data_cfg.max_prompt_length, data_cfg.truncation, "train_data"
        )
        val_files = list(data_cfg.val_files)
    else:
        train_files, val_files = resolve_files(data_cfg)
        train_set = _dataset(train_files, tokenizer, data_cfg)
    train = PromptLoader(
        train_set,
        data_cfg.train_batch_size,
        shuffle=data_cfg.shuffle,
        seed=data_cfg.seed,
        drop_last=True,
    )
    if val_rows is not None:
        val_set = PromptDataset.from_rows(
            val_rows, tokenizer, data_cfg.max_prompt_length, data_cfg.truncation, "val_data"
        )
    elif val_files:
        val_set = _dataset(val_files, tokenizer, data_cfg)
    else:
        return train, None
    val = PromptLoader(val_set, data_cfg.val_batch_size, shuffle=False, drop_last=False)
    return train, val
