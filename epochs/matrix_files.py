"""Where epoch matrix files may come from (the party's matrix directory) and what they must hold.

An operator who may record epochs must not be able to serve (and so publish, page by page, to
any anonymous client) an arbitrary file of the server. Every path is resolved before use; what
lies outside the directory is refused with one message that says nothing about it (whether it
exists, its size, its type), so the refusal cannot be used to probe the file system either.
The directory must hold none of the party's own files (its database, broker, sockets), and a
file in it is taken only with a sidecar that describes it as a matrix (pages, size, digest).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from django.conf import settings

from engine.config import engine_settings
from gpu_engine.matrix import PAGE_BYTES, file_digest, metadata_path, read_epoch_metadata

_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class MatrixPathError(ValueError):
    """The path cannot be an epoch's matrix file; the message is safe to show to the operator."""


def party_files() -> dict[str, Path]:
    """What this party writes, resolved, by what it is: the state folder, the SQLite database,
    the Celery file broker's folder, the engine server's socket."""
    found = {"the state folder (MORPHO_VAR_DIR)": settings.VAR_DIR}
    database = settings.DATABASES["default"]
    if database["ENGINE"] == "django.db.backends.sqlite3" and os.path.isabs(str(database["NAME"])):
        found["the database (DATABASE_URL)"] = database["NAME"]
    if settings.CELERY_BROKER_URL.startswith("filesystem:"):
        found["the Celery broker folder (CELERY_FILESYSTEM_BROKER_DIR)"] = (
            settings.CELERY_FILESYSTEM_BROKER_DIR)
    if engine_settings().url.startswith("ipc://"):
        found["the engine socket (MORPHO_ENGINE_URL)"] = engine_settings().url[len("ipc://"):]
    return {what: Path(os.path.realpath(path)) for what, path in found.items()}


def matrix_dir() -> Path:
    """The matrix directory, resolved: MORPHO_MATRIX_DIR, else the folder of MORPHO_MATRIX_PATH."""
    return Path(os.path.realpath(engine_settings().matrix_folder))


def shared_with_party_files() -> str | None:
    """Why the matrix directory cannot take new epochs, or None: it is, or holds, a place this
    party writes, and an epoch of one of those files would publish it (the database holds the
    users' password hashes and tokens)."""
    root = matrix_dir()
    for what, path in party_files().items():
        if path == root or path.is_relative_to(root):
            return (f"the matrix directory {root} (MORPHO_MATRIX_DIR, else the folder of "
                    f"MORPHO_MATRIX_PATH) holds {what}, {path}: expected a directory of matrix "
                    f"files alone; set MORPHO_MATRIX_DIR to one")
    return None


def check_new_matrix(path: Path, size: int) -> None:
    """MatrixPathError unless a checked file (check_matrix_file) may become an epoch's: its
    directory holds none of the party's own files, and its sidecar describes it as a matrix."""
    problem = shared_with_party_files()
    if problem:
        raise MatrixPathError(problem)
    problem = sidecar_problem(path, size)
    if problem:
        raise MatrixPathError(f"{str(path)!r} is not described as a matrix: {problem}")


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


def sidecar_problem(path: Path, size: int) -> str | None:
    """Why the sidecar `<path>.epoch.json` does not describe `path` as a matrix of `size` bytes,
    or None. It must record the file's size and SHA-256 (`manage.py make_matrix` and
    `manage.py describe_matrix` write them) and, where it says them, 4096-byte pages and their
    count. The digest is compared with the file's bytes at every load, before one is served."""
    sidecar = metadata_path(path)
    how = f"run `python manage.py describe_matrix {path}` if it is one"
    try:
        meta = read_epoch_metadata(path)
    except (OSError, ValueError) as exc:
        return f"its sidecar {sidecar} cannot be read as JSON ({exc})"
    if not meta:
        return f"expected its sidecar {sidecar} with its size and sha256; {how}"
    if not isinstance(meta, dict):
        return f"expected a JSON object in {sidecar}"
    if meta.get("size_bytes") != size:
        return (f"{sidecar} records size_bytes {meta.get('size_bytes')!r}, the file has {size} "
                f"bytes; {how}")
    if not (isinstance(meta.get("sha256"), str) and _SHA256.fullmatch(meta["sha256"])):
        return f"{sidecar} records no sha256 (64 hex digits); {how}"
    if meta.get("page_size_bytes", PAGE_BYTES) != PAGE_BYTES:
        return f"{sidecar} records page_size_bytes {meta['page_size_bytes']!r}, expected {PAGE_BYTES}"
    pages = -(-size // PAGE_BYTES)
    if meta.get("num_pages", pages) != pages:
        return f"{sidecar} records num_pages {meta['num_pages']!r}, the file holds {pages}"
    return None


def file_identity(path: Path, size: int) -> tuple[int, str]:
    """(size, SHA-256) to record for a matrix file: its sidecar's when they describe a file of
    this size (check_new_matrix requires it of a new epoch), else read and hashed now.

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
