"""Crash-safe artifact writes: a temp file in the same directory, fsync, then os.replace.

A reader sees the old file or the new one, never a torn one; a failed write (a full disk, a kill)
removes the temp file and leaves the previous artifact intact. Stdlib only, so every layer above may
use it. (scheduler/ and calibration/ import nothing from sglang_hspec: they carry their own
three-line equivalent, scheduler/sps.py `save_sps_table` and calibration/sts.py `write_bytes_atomic`.)"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


class ArtifactWriteError(OSError):
    """Writing an artifact failed; the message names the file and says the previous one is intact."""


def _write_error(path: Path, exc: OSError) -> ArtifactWriteError:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        cause, fix = "the disk may be full", f"free space in {path.parent} and run again"
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        cause, fix = "a file or directory is in the way", f"check that {path.parent} is a directory and {path.name} " \
                                                             "is not one, or write elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause, fix = "the location is not writable", f"make {path.parent} writable, or write elsewhere"
    else:
        cause, fix = "the location cannot hold files", "write elsewhere"
    err = ArtifactWriteError(
        f"could not write {path}: {reason}; {cause}. The previous {path.name} (if any) is left unchanged: {fix}")
    err.errno = exc.errno  # callers may still test for errno.ENOSPC
    return err


class _Writer:
    """The temp file, with its write errors named after the artifact (not the temp file, not a sibling)."""

    def __init__(self, file: IO, path: Path):
        self._file, self._path = file, path

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as exc:
            raise _write_error(self._path, exc) from exc

    def __getattr__(self, name):
        return getattr(self._file, name)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = "utf-8") -> Iterator[IO]:
    """`with atomic_open(path, "w") as f: ...` writes `path` all at once when the block ends without error.
    Modes "w" (text) and "wb" (binary); the parent directory is created. Nested blocks commit innermost
    first and none commits if any fails."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield _Writer(f, path)
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                raise _write_error(path, exc) from exc
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise _write_error(path, exc) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)
