"""atomic_open: all or nothing, errors named after the artifact, nested writes commit together."""

import errno
import os

import pytest

from sglang_hspec.core.atomic import ArtifactWriteError, atomic_open, atomic_write_bytes, atomic_write_text


def test_writes_and_replaces_whole_files(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_text(path, "one\n")
    atomic_write_bytes(path, b"two\n")
    assert path.read_bytes() == b"two\n" and os.listdir(path.parent) == ["a.json"]


def test_an_exception_in_the_body_keeps_the_old_file_and_passes_through(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(KeyError):
        with atomic_open(path) as f:
            f.write("new, half written")
            raise KeyError("caller's own error")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_nested_writes_commit_together_and_name_the_failing_file(tmp_path, monkeypatch):
    a, b = tmp_path / "a.bin", tmp_path / "b.txt"
    a.write_bytes(b"old a")
    b.write_text("old b")

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)  # the inner file (b) fails when it is made durable
    with pytest.raises(ArtifactWriteError) as err:
        with atomic_open(a, "wb") as fa, atomic_open(b, "w") as fb:
            fa.write(b"new a")
            fb.write("new b")
    assert str(err.value).startswith(f"could not write {b}: No space left on device; the disk may be full.")
    assert err.value.errno == errno.ENOSPC
    assert a.read_bytes() == b"old a" and b.read_text() == "old b" and sorted(os.listdir(tmp_path)) == ["a.bin", "b.txt"]


def test_rejects_append_mode(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"):
        with atomic_open(tmp_path / "x", "a"):
            pass


@pytest.mark.parametrize("code, cause", [
    (errno.ENOTDIR, "a file or directory is in the way"),
    (errno.EACCES, "the location is not writable"),
    (errno.EROFS, "the location is not writable"),
    (errno.ENOENT, "the location cannot hold files"),
])
def test_a_write_error_other_than_a_full_disk_does_not_blame_the_disk(tmp_path, monkeypatch, code, cause):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def refuse(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ArtifactWriteError) as err:
        atomic_write_text(path, "new")
    assert str(err.value).startswith(f"could not write {path}: {os.strerror(code)}; {cause}. The previous a.txt "
                                     "(if any) is left unchanged")
    assert "disk may be full" not in str(err.value) and err.value.errno == code
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["a.txt"]
