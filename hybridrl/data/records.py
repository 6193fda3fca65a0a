"""Prompt rows given as Python objects: the in-memory twin of ``hybridrl.data.schema.read_rows``.

Contract. ``rows_from_records(data, *, prompt_key="prompt", name="train_data")`` returns a list
of :class:`hybridrl.data.schema.PromptRow`, in ``data``'s order, from any of:

- an iterable (list, tuple, generator) of rows;
- a map-style dataset: ``len(data)`` and ``data[i]`` for ``i`` in ``range(len(data))`` (a
  ``datasets.Dataset``, a ``torch.utils.data.Dataset``, any sequence);
- a table: an object with ``to_pylist()`` (``pyarrow.Table``) or a pandas ``DataFrame``
  (``to_dict("records")``), or a mapping of equal-length columns (``datasets.Dataset.to_dict()``).

A row is a ``PromptRow`` or a mapping with verl's fields (the parquet schema,
``hybridrl/data/schema.py``): ``data_source`` (a non-empty string), ``prompt_key`` (a list of
``{"role", "content"}`` messages, or a string = one user message), ``reward_model`` (a mapping
with ``ground_truth``; ``style`` optional), optional ``ability`` (string) and ``extra_info``
(mapping). numpy arrays and scalars (what pandas and datasets hand out for list and number
columns) are converted to Python values. Every problem raises ``ValueError`` in one line naming
``name``, the row and the field (``train_data row 3: 'reward_model' is missing; ...``); nothing
is read lazily (every row is checked here). ``rows_digest(rows)`` is a hex digest of the rows'
content, equal on two processes exactly when they hold the same rows in the same order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from hybridrl.data.schema import PromptRow

ROW_FIELDS = "data_source, prompt (chat messages or a string), reward_model.ground_truth"


def _plain(value: Any) -> Any:
    """numpy arrays / scalars (pandas, datasets) as Python lists / numbers, recursively."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _records(data: Any, name: str) -> list[Any]:
    """The rows of ``data`` in order (see the module docstring for the accepted containers)."""
    if isinstance(data, (str, bytes)) or data is None:
        raise ValueError(f"{name}: got {type(data).__name__}; allowed: an iterable of prompt "
                         "rows, a datasets.Dataset or torch Dataset, a pyarrow or pandas table")
    if hasattr(data, "to_pylist"):  # pyarrow.Table
        return list(data.to_pylist())
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        return list(data.to_dict("records"))
    if isinstance(data, Mapping):  # columns: {"data_source": [...], "prompt": [...], ...}
        columns = {k: list(v) if not isinstance(v, (str, bytes)) else None for k, v in data.items()}
        lengths = {len(v) for v in columns.values() if v is not None}
        if None in columns.values() or len(lengths) != 1:
            raise ValueError(f"{name}: a mapping is read as columns of equal length; got "
                             f"{ {k: type(v).__name__ for k, v in data.items()} }")
        n = lengths.pop()
        return [{k: v[i] for k, v in columns.items()} for i in range(n)]
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):  # map-style datasets
        return [data[i] for i in range(len(data))]
    if isinstance(data, Iterable):
        return list(data)
    raise ValueError(f"{name}: {type(data).__name__} is not iterable; allowed: an iterable of "
                     "prompt rows, a datasets.Dataset or torch Dataset, a pyarrow or pandas table")


def _messages(value: Any, where: str, prompt_key: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: '{prompt_key}' is {type(value).__name__} {value!r:.60}; "
                         "allowed: a non-empty list of {'role', 'content'} messages or a string")
    out = []
    for j, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: '{prompt_key}' message {j} is {m!r:.60}; allowed: "
                             "{'role': str, 'content': str}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _row(record: Any, where: str, prompt_key: str) -> PromptRow:
    if isinstance(record, PromptRow):
        return record
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: got {type(record).__name__}; allowed: a PromptRow or a "
                         f"mapping with {ROW_FIELDS}")
    record = _plain(record)
    for key in ("data_source", prompt_key, "reward_model"):
        if key not in record:
            raise ValueError(f"{where}: '{key}' is missing; fields present: {sorted(record)}; "
                             f"needed: {ROW_FIELDS}")
    source = record["data_source"]
    if not isinstance(source, str) or not source:
        raise ValueError(f"{where}: 'data_source' is {source!r}; allowed: a non-empty string "
                         "(it selects the reward function)")
    reward = record["reward_model"]
    if not isinstance(reward, Mapping) or "ground_truth" not in reward:
        raise ValueError(f"{where}: 'reward_model' is {reward!r:.60}; allowed: a mapping with "
                         "'ground_truth' (and optionally 'style')")
    ability, extra = record.get("ability") or "", record.get("extra_info") or {}
    if not isinstance(ability, str):
        raise ValueError(f"{where}: 'ability' is {type(ability).__name__}; allowed: a string")
    if not isinstance(extra, Mapping):
        raise ValueError(f"{where}: 'extra_info' is {type(extra).__name__}; allowed: a mapping")
    return PromptRow(source, _messages(record[prompt_key], where, prompt_key),
                     reward["ground_truth"], ability, reward.get("style") or "", dict(extra))


def rows_from_records(data: Any, *, prompt_key: str = "prompt",
                      name: str = "train_data") -> list[PromptRow]:
    """Every row of ``data`` as a checked ``PromptRow`` (see the module docstring)."""
    rows = [_row(r, f"{name} row {i}", prompt_key) for i, r in enumerate(_records(data, name))]
    if not rows:
        raise ValueError(f"{name}: no rows; allowed: one or more prompt rows")
    return rows


def rows_digest(rows: list[PromptRow]) -> str:
    """A sha256 of the rows' fields, in order (see the module docstring)."""
    h = hashlib.sha256()
    for r in rows:
        fields = [r.data_source, r.messages, r.ground_truth, r.ability, r.reward_style,
                  r.extra_info]
        h.update(json.dumps(fields, sort_keys=True, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()
