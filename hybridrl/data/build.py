"""Build the tokenizer and the prompt loaders from the config sections (``model``, ``data``).

Contract. ``build_tokenizer(model_cfg)`` loads ``model.tokenizer_path``, else ``model.path``, else
the builtin character tokenizer. ``resolve_files(data_cfg)`` returns (train_files, val_files):
the configured parquet files, or, when ``data.train_files`` is empty, the synthetic task's
``train.parquet``/``test.parquet`` written to ``data.synthetic.dir`` (the test split stands in
for validation unless ``data.val_files`` is set). ``build_loaders(data_cfg, tokenizer)`` returns
``(train_loader, val_loader)``: the train loader shuffles with ``data.seed`` and drops the last
partial batch; the validation loader (None without validation files) keeps order and every prompt.
"""

from __future__ import annotations

from hybridrl.data.arithmetic import write_dataset
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.loader import PromptLoader
from hybridrl.data.tokenizer import load_tokenizer


def build_tokenizer(model_cfg):
    return load_tokenizer(model_cfg.tokenizer_path or model_cfg.path or "char")


def resolve_files(data_cfg) -> tuple[list[str], list[str]]:
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


def _dataset(files: list[str], tokenizer, data_cfg) -> PromptDataset:
    return PromptDataset(
        files, tokenizer, data_cfg.max_prompt_length, data_cfg.truncation, data_cfg.prompt_key
    )


def build_loaders(data_cfg, tokenizer) -> tuple[PromptLoader, PromptLoader | None]:
    train_files, val_files = resolve_files(data_cfg)
    train = PromptLoader(
        _dataset(train_files, tokenizer, data_cfg),
        data_cfg.train_batch_size,
        shuffle=data_cfg.shuffle,
        seed=data_cfg.seed,
        drop_last=True,
    )
    if not val_files:
        return train, None
    val = PromptLoader(
        _dataset(val_files, tokenizer, data_cfg),
        data_cfg.val_batch_size,
        shuffle=False,
        drop_last=False,
    )
    return train, val
