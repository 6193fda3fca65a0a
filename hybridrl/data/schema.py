"""verl's RL parquet schema: read, validate and write prompt rows with pyarrow.

Contract. A row (one prompt) has these columns, exactly as verl's preprocessing scripts
(e.g. ``examples/data_preprocess/gsm8k.py``, saved through HF ``datasets.to_parquet``) write them:

    data_source   string                                   required  (selects the reward function)
    prompt        list<struct<role: string, content: string>>  required  (chat messages)
    ability       string                                   optional  (default "")
    reward_model  struct<style: string, ground_truth: ...>  required  (ground_truth: any value)
    extra_info    struct<split, index, ...>                 optional  (default {})

``read_rows(path, prompt_key)`` returns a list of :class:`PromptRow`; every problem with the file
(not a parquet file, no rows, a missing column, a column of the wrong type, bytes that are not
UTF-8) raises ``ValueError`` naming the file and, where one is at fault, the column.
``write_rows(path, rows)`` writes rows in the same schema (string columns, int64 integers, struct
fields in insertion order), so ``read_rows(write_rows(...))`` round-trips.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS = ("data_source", "reward_model")
PROMPT_TYPE = "list<struct<role: string, content: string>>"


@dataclass
class PromptRow:
    """One prompt of a verl-schema parquet file, as Python values."""

    data_source: str
    messages: list[dict[str, str]]  # [{"role": ..., "content": ...}, ...]
    ground_truth: Any
    ability: str = ""
    reward_style: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _bad(path: str, column: str, message: str) -> ValueError:
    return ValueError(f"{path}: column '{column}' {message}")


def _check_utf8(path: str, column: str, arr: pa.ChunkedArray) -> None:
    """Raise if any string (at any nesting depth) of ``arr`` is not valid UTF-8."""
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise _bad(path, column, f"holds bytes that are not valid UTF-8 ({exc})") from exc


def _text_values(path: str, column: str, arr: pa.ChunkedArray) -> list[str]:
    """A string (or UTF-8 binary) column as Python str; nulls become ''."""
    if _is_text(arr.type):
        _check_utf8(path, column, arr)
        return ["" if v is None else v for v in arr.to_pylist()]
    if _is_bytes(arr.type):
        out = []
        for row, v in enumerate(arr.to_pylist()):
            try:
                out.append("" if v is None else v.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise _bad(path, column, f"row {row} is not valid UTF-8 ({exc})") from exc
        return out
    raise _bad(path, column, f"has type {arr.type}; allowed: string")


def _check_prompt_type(path: str, column: str, t: pa.DataType) -> None:
    if _is_text(t):
        return
    ok = _is_list(t) and pa.types.is_struct(t.value_type)
    if ok:
        names = {t.value_type.field(i).name for i in range(t.value_type.num_fields)}
        ok = {"role", "content"} <= names and all(
            _is_text(t.value_type.field(n).type) for n in ("role", "content")
        )
    if not ok:
        raise _bad(path, column, f"has type {t}; allowed: {PROMPT_TYPE} (or string)")


def _messages(path: str, column: str, arr: pa.ChunkedArray) -> list[list[dict[str, str]]]:
    _check_prompt_type(path, column, arr.type)
    _check_utf8(path, column, arr)
    out = []
    for row, value in enumerate(arr.to_pylist()):
        if value is None:
            raise _bad(path, column, f"row {row} is null; allowed: a list of messages")
        if isinstance(value, str):
            out.append([{"role": "user", "content": value}])
            continue
        if not value:
            raise _bad(path, column, f"row {row} is an empty list; allowed: >= 1 message")
        out.append([{"role": m["role"] or "", "content": m["content"] or ""} for m in value])
    return out


def _reward_model(path: str, arr: pa.ChunkedArray) -> tuple[list[Any], list[str]]:
    t = arr.type
    names = [t.field(i).name for i in range(t.num_fields)] if pa.types.is_struct(t) else []
    if "ground_truth" not in names:
        raise _bad(
            path, "reward_model", f"has type {t}; allowed: struct<style: string, ground_truth: any>"
        )
    _check_utf8(path, "reward_model", arr)
    values = arr.to_pylist()
    truths = [None if v is None else v.get("ground_truth") for v in values]
    styles = ["" if v is None else (v.get("style") or "") for v in values]
    return truths, styles


def _extra_info(path: str, arr: pa.ChunkedArray | None, n: int) -> list[dict[str, Any]]:
    if arr is None:
        return [{} for _ in range(n)]
    if not (pa.types.is_struct(arr.type) or pa.types.is_map(arr.type)):
        raise _bad(path, "extra_info", f"has type {arr.type}; allowed: struct<split, index, ...>")
    _check_utf8(path, "extra_info", arr)
    values = arr.to_pylist()
    if pa.types.is_map(arr.type):
        return [dict(v) if v else {} for v in values]
    return [v or {} for v in values]


def read_table(path: str) -> pa.Table:
    """The parquet file at ``path`` as an arrow table; ValueError if it is missing/empty/invalid."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such parquet file")
    if os.path.getsize(path) == 0:
        raise ValueError(
            f"{path}: file is empty (0 bytes); allowed: a parquet file in verl's schema"
        )
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc


def read_rows(path: str, prompt_key: str = "prompt") -> list[PromptRow]:
    """Validate and convert every row of a verl-schema parquet file (see module docstring)."""
    table = read_table(path)
    if table.num_rows == 0:
        raise ValueError(f"{path}: parquet file has no rows")
    for column in (prompt_key, *REQUIRED_COLUMNS):
        if column not in table.column_names:
            raise _bad(path, column, f"is missing; columns present: {table.column_names}")
    n = table.num_rows
    sources = _text_values(path, "data_source", table.column("data_source"))
    messages = _messages(path, prompt_key, table.column(prompt_key))
    truths, styles = _reward_model(path, table.column("reward_model"))
    abilities = (
        _text_values(path, "ability", table.column("ability"))
        if "ability" in table.column_names
        else [""] * n
    )
    extra = _extra_info(
        path, table.column("extra_info") if "extra_info" in table.column_names else None, n
    )
    return [
        PromptRow(sources[i], messages[i], truths[i], abilities[i], styles[i], extra[i])
        for i in range(n)
    ]


def write_rows(path: str, rows: list[PromptRow]) -> str:
    """Write ``rows`` as a verl-schema parquet file at ``path``; returns ``path``."""
    if not rows:
        raise ValueError(f"{path}: refusing to write a parquet file with no rows")
    records = [
        {
            "data_source": r.data_source,
            "prompt": [{"role": m["role"], "content": m["content"]} for m in r.messages],
            "ability": r.ability,
            "reward_model": {"style": r.reward_style, "ground_truth": r.ground_truth},
            "extra_info": r.extra_info,
        }
        for r in rows
    ]
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(
            f"{path}: rows do not share one type per column (e.g. ground_truth str in one row, "
            f"int in another): {exc}"
        ) from exc
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"  # several ranks may write the same file: replace atomically
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
