"""Data: verl-schema parquet prompts, tokenizers, the synthetic arithmetic task, batching.

Contract: see each module. ``schema`` reads/writes verl's parquet rows, ``tokenizer`` provides the
builtin character tokenizer and local HF tokenizers, ``records`` takes the same rows as Python
objects (lists of dicts, datasets / torch datasets, tables), ``dataset`` tokenizes prompts with
max_prompt_length handling, ``loader`` yields seeded resumable batches, ``arithmetic`` writes the
CPU demo task, ``batching`` plans mini/micro-batches (pure index math), ``build`` makes the
tokenizer and loaders from the config sections.
"""

from hybridrl.data.dataset import PromptBatch, PromptDataset, collate
from hybridrl.data.loader import PromptLoader
from hybridrl.data.records import rows_from_records
from hybridrl.data.schema import PromptRow, read_rows, write_rows
from hybridrl.data.tokenizer import CharTokenizer, encode_prompt, load_tokenizer

__all__ = [
    "CharTokenizer",
    "PromptBatch",
    "PromptDataset",
    "PromptLoader",
    "PromptRow",
    "collate",
    "encode_prompt",
    "load_tokenizer",
    "read_rows",
    "rows_from_records",
    "write_rows",
]
