"""The page matrix (docs/PROTOCOL.md section 1) and epochs: load, generate, metadata, row writes."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Tuple

import numpy as np

from morpho_pir.protocol import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, parse_hex

WORDS_PER_PAGE = PAGE_BYTES // 4  # 1024 u32 words
WORDS_PER_ROW = ROW_BYTES // 4
_GEN_CHUNK_PAGES = 4096  # pages drawn per RNG call (16 MiB) when generating
READ_CHUNK_BYTES = 64 << 20  # a matrix file is read and hashed 64 MiB at a time
LOG_PROGRESS_BYTES = 1 << 30  # files from 1 GiB on log their loading every tenth

log = logging.getLogger(__name__)


class MatrixChanged(ValueError):
    """The matrix file is not the one its epoch recorded (size or content), or changed in a read."""


def domain_bits_for(num_pages: int, configured: Optional[int] = None) -> int:
    """The smallest d >= 1 with 2**d >= num_pages, or the operator's larger `configured` one."""
    if num_pages < 1:
        raise ValueError(f"a matrix needs at least one page, got {num_pages}")
    needed = max(1, (num_pages - 1).bit_length())
    if configured is None:
        return needed
    if configured < needed:
        raise ValueError(
            f"domain_bits {configured} is too small for {num_pages} pages (needs >= {needed})"
        )
    if configured > 32:
        raise ValueError(f"domain_bits {configured} is above the maximum of 32")
    return configured


class _Shape:
    """What follows from num_pages: the sizes every holder of a matrix (or of its shape) reports."""

    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.num_pages * PAGE_BYTES

    @property
    def num_rows(self) -> int:
        return self.num_pages * ROWS_PER_PAGE

    def check_row(self, index: int, data: bytes) -> None:
        if not 0 <= index < self.num_rows:
            raise ValueError(f"row {index} is outside [0, {self.num_rows})")
        if len(data) != ROW_BYTES:
            raise ValueError(f"row {index} data is {len(data)} bytes, expected {ROW_BYTES}")

    def check_rows(self, rows: Mapping[int, bytes]) -> None:
        """check_row for every row of `rows` (index -> 256 bytes), before any is written."""
        for index, data in rows.items():
            self.check_row(index, data)


class PageMatrix(_Shape):
    """num_pages pages of 4096 bytes as u32 words, in memory private to this process.

    The body may be followed by a one-page tail (zero-padded): read pages through
    block()/iter_blocks(), not a single array. A matrix loaded from a file carries the file's
    size and SHA-256 (`size_bytes`, `sha256`), which its bytes were checked against.
    """

    def __init__(
        self,
        body: np.ndarray,
        tail: Optional[np.ndarray] = None,
        domain_bits: Optional[int] = None,
        source: Optional[str] = None,
    ) -> None:
        for name, arr in (("body", body), ("tail", tail)):
            if arr is None:
                continue
            if arr.dtype != np.uint32 or arr.ndim != 2 or arr.shape[1] != WORDS_PER_PAGE:
                raise ValueError(f"{name} must be (n, {WORDS_PER_PAGE}) uint32, got {arr.dtype} {arr.shape}")
            if not arr.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous")
        if tail is not None and tail.shape[0] != 1:
            raise ValueError(f"tail must hold exactly one page, got {tail.shape[0]}")
        self._body = body
        self._tail = tail
        self.num_pages = body.shape[0] + (0 if tail is None else 1)
        self.domain_bits = domain_bits_for(self.num_pages, domain_bits)
        self.source = source  # file path, or None for a generated matrix
        self.size_bytes: Optional[int] = None  # of the file, for a matrix loaded from one
        self.sha256: Optional[str] = None  # hex digest of the file's bytes, as loaded

    def block(self, start: int, stop: int) -> np.ndarray:
        """Pages [start, stop) as a (n, 1024) u32 array: a view where it can be, else a copy."""
        if not 0 <= start <= stop <= self.num_pages:
            raise IndexError(f"page range [{start}, {stop}) outside [0, {self.num_pages})")
        body_pages = self._body.shape[0]
        if stop <= body_pages:
            return self._body[start:stop]
        return np.concatenate([self._body[start:body_pages], self._tail])

    def pages(self, start: int, stop: int, domain_bits: Optional[int] = None) -> "PageMatrix":
        """Pages [start, stop) as a matrix of their own, sharing this one's memory (a row written
        in either shows in both): the part of an epoch one device holds (gpu_engine.placement)."""
        if not 0 <= start < stop <= self.num_pages:
            raise IndexError(f"page range [{start}, {stop}) outside [0, {self.num_pages}) or empty")
        body_pages = self._body.shape[0]
        body = self._body[min(start, body_pages):min(stop, body_pages)]
        tail = self._tail if stop > body_pages else None
        return PageMatrix(body, tail, domain_bits=domain_bits, source=self.source)

    def iter_blocks(self, pages_per_block: int) -> Iterator[Tuple[int, np.ndarray]]:
        """(first_page, block) over the whole matrix in order."""
        for start in range(0, self.num_pages, pages_per_block):
            yield start, self.block(start, min(self.num_pages, start + pages_per_block))

    def page(self, index: int) -> bytes:
        return self.block(index, index + 1).astype("<u4").tobytes()

    def row(self, index: int) -> bytes:
        page, slot = divmod(index, ROWS_PER_PAGE)
        return self.page(page)[slot * ROW_BYTES : (slot + 1) * ROW_BYTES]

    def write_row(self, index: int, data: bytes) -> None:
        """Overwrite one row in place (private to this process: the file is never written)."""
        self.check_row(index, data)
        page, slot = divmod(index, ROWS_PER_PAGE)
        words = np.frombuffer(data, dtype="<u4")
        target = self._body if page < self._body.shape[0] else self._tail
        local = page if target is self._body else 0
        target[local, slot * WORDS_PER_ROW : (slot + 1) * WORDS_PER_ROW] = words


ProgressFn = Callable[[int, int], None]  # progress(done_bytes, total_bytes)


def _progress_logger(path, total: int) -> Optional[ProgressFn]:
    if total < LOG_PROGRESS_BYTES:
        return None
    last = [-1]

    def report(done: int, _total: int) -> None:
        tenth = done * 10 // total
        if tenth != last[0]:
            last[0] = tenth
            log.info("reading and hashing matrix file %s: %d%% (%.1f of %.1f GiB)",
                     path, tenth * 10, done / (1 << 30), total / (1 << 30))

    return report


def file_digest(path, progress: Optional[ProgressFn] = None) -> Tuple[int, str]:
    """(size in bytes, SHA-256 hex) of a file, read 64 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        total = os.fstat(fh.fileno()).st_size
        report = progress or _progress_logger(path, total)
        done = 0
        while chunk := fh.read(READ_CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            if report:
                report(done, total)
    return done, digest.hexdigest()


def load_matrix(
    path,
    domain_bits: Optional[int] = None,
    size_bytes: Optional[int] = None,
    sha256: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
) -> PageMatrix:
    """Read a matrix file into this process's memory and hash it; a partial last page is padded.

    The pages served are a private copy of exactly the bytes hashed: the file may be overwritten
    or truncated afterwards without changing an answer or faulting (a mapping of the file
    would do both). `size_bytes` and `sha256`, when given (the epoch's record), must match, else
    MatrixChanged says what differs; the file growing or shrinking while it is read is refused too.
    Progress: progress(done, total), else a log line every tenth for files from 1 GiB.
    """
    path = Path(path)
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise ValueError(f"matrix file {path} is empty")
        if size_bytes is not None and size != size_bytes:
            raise MatrixChanged(
                f"matrix file {path} changed since its epoch was recorded: {size} bytes, "
                f"expected {size_bytes}"
            )
        num_pages = -(-size // PAGE_BYTES)
        # Zeroed pages come from the OS untouched, so the padding of a partial page costs nothing.
        body = np.zeros((num_pages, WORDS_PER_PAGE), dtype=np.uint32)
        view = memoryview(body).cast("B")
        digest = hashlib.sha256()
        report = progress or _progress_logger(path, size)
        done = 0
        while done < size:
            got = fh.readinto(view[done : min(size, done + READ_CHUNK_BYTES)])
            if not got:
                raise MatrixChanged(
                    f"matrix file {path} shrank while it was read: {done} of {size} bytes"
                )
            digest.update(view[done : done + got])  # hashlib frees the GIL for large buffers
            done += got
            if report:
                report(done, size)
        if fh.read(1):
            raise MatrixChanged(f"matrix file {path} grew while it was read (from {size} bytes)")
    found = digest.hexdigest()
    if sha256 is not None and found != sha256.lower():
        raise MatrixChanged(
            f"matrix file {path} changed since its epoch was recorded: sha256 {found}, "
            f"expected {sha256.lower()}"
        )
    if not np.little_endian:  # the file holds little-endian u32 words
        body.byteswap(inplace=True)
    matrix = PageMatrix(body, domain_bits=domain_bits, source=str(path))
    matrix.size_bytes, matrix.sha256 = size, found
    return matrix


def _random_blocks(num_pages: int, seed: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    for start in range(0, num_pages, _GEN_CHUNK_PAGES):
        n = min(_GEN_CHUNK_PAGES, num_pages - start)
        yield rng.integers(0, 1 << 32, size=(n, WORDS_PER_PAGE), dtype=np.uint32)


def random_matrix(num_pages: int, seed: int = 0, domain_bits: Optional[int] = None) -> PageMatrix:
    """A seeded random matrix in memory; the same pages write_matrix_file writes for that seed."""
    if num_pages < 1:
        raise ValueError(f"a matrix needs at least one page, got {num_pages}")
    body = np.concatenate(list(_random_blocks(num_pages, seed)))
    return PageMatrix(body, domain_bits=domain_bits)


def write_matrix_file(path, num_pages: int, seed: int = 0, progress=None) -> Path:
    """Write a seeded random matrix file in 16 MiB chunks; progress(done_pages, num_pages)."""
    if num_pages < 1:
        raise ValueError(f"a matrix needs at least one page, got {num_pages}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    done = 0
    with open(tmp, "wb") as fh:
        for block in _random_blocks(num_pages, seed):
            fh.write(block.astype("<u4").tobytes())
            done += block.shape[0]
            if progress:
                progress(done, num_pages)
    os.replace(tmp, path)  # a crash never leaves a half-written matrix under the real name
    return path


@dataclass(frozen=True)
class ServedEpoch:
    """One epoch as an engine serves it: an immutable matrix and its metadata (docs/PROTOCOL.md
    section 6). The epochs app's `Epoch` is the database record an operator keeps of one."""

    epoch_id: int
    matrix: PageMatrix = field(compare=False)
    block_number: int = 0
    state_root: bytes = bytes(32)
    seeds: Tuple[int, int, int] = (0, 0, 0)
    # how an engine of several devices places the pages (gpu_engine.placement.Placement's value)
    placement: str = "auto"

    def __post_init__(self) -> None:
        if self.epoch_id < 0:
            raise ValueError(f"epoch_id must be >= 0, got {self.epoch_id}")
        if len(self.state_root) != 32:
            raise ValueError(f"state_root must be 32 bytes, got {len(self.state_root)}")
        if len(self.seeds) != 3 or any(not 0 <= s < (1 << 64) for s in self.seeds):
            raise ValueError(f"seeds must be three u64 values, got {self.seeds!r}")

    def describe(self) -> dict:
        """The JSON of GET /epoch (docs/PROTOCOL.md section 5)."""
        return {
            "epoch_id": self.epoch_id,
            "num_rows": self.matrix.num_rows,
            "seeds": list(self.seeds),
            "block_number": self.block_number,
            "state_root": "0x" + self.state_root.hex(),
            "page_pir": {
                "domain_bits": self.matrix.domain_bits,
                "rows_per_page": ROWS_PER_PAGE,
                "num_pages": self.matrix.num_pages,
                "page_size_bytes": PAGE_BYTES,
            },
        }


@dataclass(frozen=True)
class MatrixShape(_Shape):
    """A matrix's shape without its pages: what a process whose engine runs elsewhere knows."""

    num_pages: int
    domain_bits: int


def epoch_from_description(data: dict) -> ServedEpoch:
    """The ServedEpoch that its describe() described, with a MatrixShape for its matrix."""
    root = data["state_root"]
    pir = data["page_pir"]
    return ServedEpoch(
        epoch_id=int(data["epoch_id"]),
        matrix=MatrixShape(int(pir["num_pages"]), int(pir["domain_bits"])),  # type: ignore[arg-type]
        block_number=int(data["block_number"]),
        state_root=parse_hex(root),
        seeds=tuple(int(s) for s in data["seeds"]),  # type: ignore[arg-type]
    )


def metadata_path(matrix_path) -> Path:
    return Path(str(matrix_path) + ".epoch.json")


def read_epoch_metadata(matrix_path) -> dict:
    """The sidecar `<path>.epoch.json` of a matrix file, or {} when there is none."""
    meta_file = metadata_path(matrix_path)
    return json.loads(meta_file.read_text()) if meta_file.exists() else {}


def write_epoch_metadata(
    matrix_path, epoch_id: int = 1, block_number: int = 0, state_root: bytes = bytes(32),
    seeds: Tuple[int, int, int] = (0, 0, 0), progress: Optional[ProgressFn] = None,
) -> Path:
    """Write the sidecar, with the file's size and SHA-256 (read now) that every load checks."""
    size, digest = file_digest(matrix_path, progress)
    out = metadata_path(matrix_path)
    out.write_text(json.dumps({
        "epoch_id": epoch_id,
        "block_number": block_number,
        "state_root": "0x" + state_root.hex(),
        "seeds": list(seeds),
        "page_size_bytes": PAGE_BYTES,
        "num_pages": -(-size // PAGE_BYTES),
        "size_bytes": size,
        "sha256": digest,
    }, indent=2) + "\n")
    return out


def load_epoch(matrix_path, domain_bits: Optional[int] = None) -> ServedEpoch:
    """The matrix file plus its sidecar `<path>.epoch.json` (epoch 1 with zero metadata if absent).

    The file must have the size and SHA-256 its sidecar records (MatrixChanged otherwise), so a
    file changed in place is never served under the sidecar's epoch_id. A sidecar without them
    (written before they were recorded) is loaded with a warning.
    """
    meta = read_epoch_metadata(matrix_path)
    if meta and "sha256" not in meta:
        log.warning("%s records no size and sha256: the matrix file cannot be checked against "
                    "epoch %s (`manage.py make_matrix` writes them)", metadata_path(matrix_path),
                    meta.get("epoch_id", 1))
    matrix = load_matrix(matrix_path, domain_bits, size_bytes=meta.get("size_bytes"),
                         sha256=meta.get("sha256"))
    root = meta.get("state_root", "0x" + "00" * 32)
    return ServedEpoch(
        epoch_id=int(meta.get("epoch_id", 1)),
        matrix=matrix,
        block_number=int(meta.get("block_number", 0)),
        state_root=parse_hex(root),
        seeds=tuple(int(s) for s in meta.get("seeds", (0, 0, 0))),
    )
