"""Where epoch matrix files may come from (the party's matrix directory) and what they must hold.

An operator who may record epochs must not be able to serve (and so publish, page by page, to
any anonymous client) an arbitrary file of the server. Every path is resolved before use; what
lies outside the directory is refused with one message that says nothing about it (whether it
exists, its size, its type), so the refusal cannot be used to probe the file system either.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from engine.config import engine_settings
from gpu_engine.matrix import file_digest, read_epoch_metadata

_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class MatrixPathError(ValueError):
    """The path cannot be an epoch's matrix file; the message is safe to show to the operator."""


def matrix_dir() -> Path:
    """The matrix directory, resolved: MORPHO_MATRIX_DIR, else the folder of MORPHO_MATRIX_PATH."""
    return Path(os.path.realpath(engine_settings().matrix_folder))


def _outside(root: Path, given: str) -> MatrixPathError:
    # The same words for every path outside, whatever is (or is not) there.
    return MatrixPathError(
        f"expected a file inside the matrix directory {root} (MORPHO_MATRIX_DIR): a path under "
        f"it without '..' and without symlinks that lead out of it; got {given!r}"
    )


def _under(path: Path, root: Path) -> bool:
    return path != root and path.is_relative_to(root)


def confine(given) -> Path:
    """The resolved path of `given` if it names a place inside the matrix directory.

    A relative path is taken from the directory. Refused, with one message: '..' anywhere, a NUL
    byte, an absolute path outside the directory, and a path inside whose resolution (through
    symlinks, of the file or of a folder on the way) ends outside it.
    """
    root = matrix_dir()
    text = str(given)
    if not text or "\x00" in text or ".." in Path(text).parts:
        raise _outside(root, text)
    spelled = Path(os.path.abspath(engine_settings().matrix_folder))  # the directory as configured, before symlinks
    candidate = Path(text)
    if not candidate.is_absolute():
        candidate = root / candidate
    candidate = Path(os.path.normpath(candidate))
    # Lexically first, so nothing outside is ever looked at (not even resolved).
    if not (_under(candidate, root) or _under(candidate, spelled)):
        raise _outside(root, text)
    resolved = Path(os.path.realpath(candidate))
    if not _under(resolved, root):
        raise _outside(root, text)
    return resolved


def check_matrix_file(given) -> tuple[Path, int]:
    """(resolved path, size in bytes) of a readable, non-empty regular file inside the directory.

    Past confinement, messages may describe the file: it is in the operator's own directory.
    """
    path = confine(given)
    root = matrix_dir()
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise MatrixPathError(
            f"no matrix file at {str(path)!r} (it must exist in {root})"
        ) from None
    except OSError as exc:
        raise MatrixPathError(f"matrix file {str(path)!r} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise MatrixPathError(f"{str(path)!r} is not a regular file")
    if info.st_size == 0:
        raise MatrixPathError(f"matrix file {str(path)!r} is empty")
    if not os.access(path, os.R_OK):
        raise MatrixPathError(f"matrix file {str(path)!r} cannot be read by this server")
    return path, info.st_size


def file_identity(path: Path, size: int) -> tuple[int, str]:
    """(size, SHA-256) to record for a matrix file: its sidecar's when they describe a file of
    this size (make_matrix writes them), else read and hashed now (progress logged from 1 GiB).

    Every load checks the file against what is recorded here, so a stale sidecar can only make
    the epoch refuse to load, never serve other bytes.
    """
    try:
        meta = read_epoch_metadata(path)
    except (OSError, ValueError):
        meta = {}
    digest = meta.get("sha256")
    if meta.get("size_bytes") == size and isinstance(digest, str) and _SHA256.fullmatch(digest):
        return size, digest.lower()
    return file_digest(path)
