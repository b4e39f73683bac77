"""Prompt files as upstream slime reads them: `.parquet` (rows, through pyarrow) or JSON lines (`.jsonl`, one
object per line), with upstream's row-slice suffix `PATH@[start:end]` (Python slice bounds, negative allowed).

`read_records(path)` yields `(where, record)`: `where` names the line or row for error messages.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any, Iterator


class PromptFileError(ValueError):
    """An unreadable prompt file. One line: the problem and the fix."""


def split_row_slice(spec: str) -> tuple[str, slice | None]:
    """'data.parquet@[10:-5]' -> ('data.parquet', slice(10, -5)); a path without the suffix -> (path, None)."""
    m = re.fullmatch(r"(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]", spec)
    if m is None:
        return spec, None
    start, stop = (int(v) if v else None for v in (m["start"], m["stop"]))
    return m["path"], slice(start, stop)


def _jsonl(path: str, flag: str) -> Iterator[tuple[str, Any]]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise PromptFileError(f"{flag} {path} cannot be read ({e.strerror}); pass a .jsonl or .parquet file") from e
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptFileError(f"{path}:{lineno} is not valid JSON ({_json_reason(e, line)}); write one "
                                          "JSON object per line") from e
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{flag} {path} is not UTF-8 text ({e.reason}); pass a .jsonl or .parquet file") from e


def _json_reason(e: json.JSONDecodeError, line: str) -> str:
    """json's whole reason: its message alone can end mid-sentence ("Invalid control character at"), so the
    column and the character there complete it."""
    text = line.rstrip("\r\n")
    char = repr(text[e.pos]) if e.pos < len(text) else "the end of the line"
    if e.msg.endswith(" at"):
        message = e.msg[:-3]
        reason = f"{message} {char} at column {e.colno}"
    else:
        message, reason = e.msg, f"{e.msg} at column {e.colno}, found {char}"
    if message == "Invalid control character":
        reason += "; escape tabs and newlines inside strings as \\t and \\n"
    return reason


def _parquet(path: str, flag: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise PromptFileError(f"{flag} {path}: reading .parquet needs pyarrow; pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise PromptFileError(f"{flag} {path} is not a readable parquet file ({e}); pass a .jsonl or .parquet "
                              "file") from e
    row = 0
    for batch in pf.iter_batches():
        for record in batch.to_pylist():
            yield f"{path} row {row}", record
            row += 1


def read_records(spec: str, flag: str = "--prompt-data") -> Iterator[tuple[str, Any]]:
    path, rows = split_row_slice(spec)
    if not os.path.exists(path):
        raise PromptFileError(f"{flag} {path} cannot be read (no such file); pass a .jsonl or .parquet file")
    records = _parquet(path, flag) if path.endswith(".parquet") else _jsonl(path, flag)
    if rows is None:
        yield from records
    elif (rows.start or 0) < 0 or (rows.stop or 0) < 0:
        yield from list(records)[rows]  # a negative bound needs the row count
    else:
        yield from itertools.islice(records, rows.start, rows.stop)
