"""Records that change: a key set or deleted in the active records epoch becomes row updates.

The rows a change reads are the served state: the epoch's matrix file with its pending row
updates written over it, both from what every process of the party shares (the file and the
database). The change is computed and stored in one transaction, which holds the database's
write lock, so changes of one party are serialised and each sees the rows the previous wrote;
the same changes in the same order write the same rows on every party (gpu_engine.records).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, List

from django.db.models import Q

from epochs import sync
from epochs.matrix_files import check_matrix_file
from epochs.models import RecordChange, RecordOp, RowUpdate
from gpu_engine.matrix import MatrixChanged
from gpu_engine.records import NoRoom, TableView
from morpho_pir.protocol import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, parse_hex

__all__ = ["NoRoom", "apply_change"]


@contextmanager
def served_pages(record) -> Iterator:
    """read_page(page) -> its 16 rows as served: the file's bytes, pending updates over them."""
    path, size = check_matrix_file(record.matrix_path)
    if record.size_bytes is not None and size != record.size_bytes:
        raise MatrixChanged(f"matrix file {path} changed since epoch {record.epoch_id} was "
                            f"recorded: {size} bytes, expected {record.size_bytes}")
    fd = os.open(path, os.O_RDONLY)
    try:
        def read_page(page: int) -> List[bytes]:
            data = os.pread(fd, PAGE_BYTES, page * PAGE_BYTES).ljust(PAGE_BYTES, b"\0")
            rows = [data[slot * ROW_BYTES:(slot + 1) * ROW_BYTES] for slot in range(ROWS_PER_PAGE)]
            first = page * ROWS_PER_PAGE
            written, _ = sync.final_rows(Q(epoch_id=record.epoch_id),
                                         range(first, first + ROWS_PER_PAGE))
            for row, content in written.items():
                rows[row - first] = content
            return rows

        yield read_page
    finally:
        os.close(fd)


def apply_change(change: RecordChange) -> RecordChange:
    """Turn a validated change into row updates of the active epoch, store them with the change,
    and apply them to this party's engine before returning. NoRoom (nothing stored) when a set
    finds no free row within its eviction walk."""

    def store() -> RecordChange:
        # Read again inside the transaction: the active epoch is the one whose rows are read.
        record, table = change.table()
        change.epoch_id = record.epoch_id
        key = parse_hex(change.key)
        with served_pages(record) as read_page:
            view = TableView(table, read_page)
            if change.op == RecordOp.DELETE:
                written = view.delete(key)
            else:
                written = view.set(key, parse_hex(change.value), change.record_type)
        for row, content in written.items():
            RowUpdate(epoch_id=record.epoch_id, first_epoch_id=record.epoch_id, row=row,
                      data="0x" + content.hex(), created_by=change.created_by).save()
        change.rows = list(written)
        change.save()
        return change

    return sync.store_then_apply(store)
