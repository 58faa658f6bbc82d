"""Reading key -> value records for build_records: CSV or JSON Lines, columns named by option."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Iterator, Optional, Tuple

import numpy as np

from morpho_pir.protocol import parse_hex

FORMATS = ("csv", "jsonl")
_SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}


class RecordsInputError(ValueError):
    """A record file that cannot be read as asked; the message names the line and the column."""


def format_of(path, given: Optional[str]) -> str:
    if given:
        return given
    found = _SUFFIXES.get(Path(path).suffix.lower())
    if found is None:
        raise RecordsInputError(f"--format: cannot tell the format of {path} from its name; "
                                f"expected one of {', '.join(FORMATS)}")
    return found


def _rows(path, fmt: str) -> Iterator[Tuple[int, dict]]:
    with open(path, newline="" if fmt == "csv" else None, encoding="utf-8") as fh:
        if fmt == "csv":
            reader = csv.DictReader(fh)
            for row in reader:
                yield reader.line_num, row
            return
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordsInputError(f"line {number}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise RecordsInputError(f"line {number}: expected a JSON object, got "
                                        f"{type(row).__name__}")
            yield number, row


def _field(row: dict, number: int, column: str):
    if column not in row or row[column] is None:
        raise RecordsInputError(f"line {number}: no column {column!r} (columns: "
                                f"{', '.join(map(str, row))})")
    return row[column]


def _hex(row: dict, number: int, column: str, size: Optional[int]) -> bytes:
    text = _field(row, number, column)
    try:
        raw = parse_hex(text.strip() if isinstance(text, str) else text)
    except ValueError as exc:
        raise RecordsInputError(f"line {number}, column {column!r}: {exc}") from None
    if size is not None and len(raw) != size:
        raise RecordsInputError(f"line {number}, column {column!r}: expected {size} bytes, got "
                                f"{len(raw)} (every record's {column} has one length)")
    return raw


def read_records(path, fmt: Optional[str] = None, key_column: str = "key",
                 value_column: str = "value", type_column: Optional[str] = None,
                 key_bytes: Optional[int] = None, value_bytes: Optional[int] = None,
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys (n, K), values (n, V), types (n,)) as u8 arrays. Keys and values are hex (0x
    optional); without key_bytes/value_bytes the first record's lengths are every record's.
    Without a type column every record has type 1."""
    fmt = format_of(path, fmt)
    keys, values, types = [], [], []
    for number, row in _rows(path, fmt):
        key = _hex(row, number, key_column, key_bytes)
        value = _hex(row, number, value_column, value_bytes)
        key_bytes, value_bytes = len(key), len(value)
        record_type = 1
        if type_column is not None:
            raw = _field(row, number, type_column)
            try:
                record_type = int(raw)
            except (TypeError, ValueError):
                record_type = -1
            if not 1 <= record_type <= 255:
                raise RecordsInputError(f"line {number}, column {type_column!r}: expected an "
                                        f"integer in 1..255, got {raw!r}")
        keys.append(key)
        values.append(value)
        types.append(record_type)
    if not keys:
        raise RecordsInputError(f"{path}: no records")
    if key_bytes == 0:
        raise RecordsInputError(f"column {key_column!r}: keys must be at least one byte")
    return (np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), key_bytes),
            np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), value_bytes),
            np.array(types, dtype=np.uint8))
