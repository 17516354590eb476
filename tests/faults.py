"""Fault injection shared by the tests and scripts/bad_inputs.py (test support, never shipped)."""

from __future__ import annotations

import contextlib
import errno
import os


@contextlib.contextmanager
def disk_full_after(free_bytes: int):
    """Every file opened through os.fdopen (the atomic writers' temp files) writes while the disk has room
    (`free_bytes` in all, shared by every file), then fails with ENOSPC the way a full disk does, after
    writing what fitted."""
    real, free = os.fdopen, [free_bytes]

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if len(data) > free[0]:
                self.f.write(data[: free[0]])
                free[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            free[0] -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    os.fdopen = lambda *a, **k: Full(real(*a, **k))
    try:
        yield
    finally:
        os.fdopen = real
