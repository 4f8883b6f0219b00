"""ci.atomic: a reader sees the old file or the new one, and a failed write leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ci import atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "decision.json"
    target.write_text('{"good": true}\n', encoding="utf-8")

    def fail_fsync(fd: int) -> None:  # what `ulimit -f` or a full disk does half-way through a write
        raise OSError(27, "File too large")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="File too large"):
        atomic.write_text(target, '{"new": "' + "x" * 100000 + '"}\n')
    assert target.read_text(encoding="utf-8") == '{"good": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["decision.json"]


def test_atomic_write_keeps_the_usual_mode(tmp_path: Path) -> None:
    path = atomic.write_text(tmp_path / "new.txt", "x")
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_failed_write_removes_the_folders_it_made_and_names_the_path(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError) as info:
        atomic.write_text(tmp_path / "new" / "sub" / "decision.json", "{}\n")
    assert info.value.filename == str(tmp_path / "new" / "sub" / "decision.json")
    with pytest.raises(OSError) as info, atomic.staging_dir(tmp_path / "made" / "report") as stage:
        (stage / "a.png").write_bytes(b"x")
        raise OSError(27, "File too large")  # as PIL raises it, naming no file
    assert info.value.filename == str(tmp_path / "made" / "report")
    assert list(tmp_path.iterdir()) == []

