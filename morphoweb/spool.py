"""A byte queue for the front end: in memory up to a size, then in a temporary file."""
from __future__ import annotations

import collections
import tempfile
from typing import IO, Optional


class Spool:
    """Bytes written at one end and read, in order, at the other. The first `memory_bytes` of a
    backlog stay in memory; the rest goes to an anonymous temporary file, which is emptied and
    closed as soon as it has been read. (Its writes and reads block the event loop for the time
    of a page-cache copy, a few microseconds per 64 KiB.)"""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.chunks: collections.deque[bytes] = collections.deque()
        self.in_memory = 0
        self.file: Optional[IO[bytes]] = None
        self.file_read = 0
        self.file_written = 0
        self.written = 0  # bytes written since the start

    @property
    def pending(self) -> int:
        """Bytes written and not read yet."""
        return self.in_memory + self.file_written - self.file_read

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.written += len(data)
        if self.file is None and self.in_memory + len(data) <= self.memory_bytes:
            self.chunks.append(bytes(data))
            self.in_memory += len(data)
            return
        if self.file is None:
            self.file = tempfile.TemporaryFile(prefix="morphoweb-spool-")
        self.file.seek(self.file_written)
        self.file.write(data)
        self.file_written += len(data)

    def read(self, size: int) -> bytes:
        """Up to `size` bytes (b"" when nothing is pending); memory first, it was written first."""
        if self.chunks:
            chunk = self.chunks.popleft()
            if len(chunk) > size:
                self.chunks.appendleft(chunk[size:])
                chunk = chunk[:size]
            self.in_memory -= len(chunk)
            return chunk
        if self.file is None:
            return b""
        self.file.seek(self.file_read)
        data = self.file.read(min(size, self.file_written - self.file_read))
        self.file_read += len(data)
        if self.file_read == self.file_written:
            self._drop_file()  # all read (memory was read before it): back to memory
        return data

    def close(self) -> None:
        """Drop whatever is pending, and the file."""
        self.chunks.clear()
        self.in_memory = 0
        self._drop_file()

    def _drop_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.file_read = self.file_written = 0
