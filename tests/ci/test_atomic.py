"""ci.atomic and the other writers of the pipeline's files: a reader sees the old file or the new one,
a failed write leaves nothing behind, and a target that is a hard link is replaced, never written
through (the file's other name keeps its content)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.suites import decode
from ci import atomic, config_edit, history_store
from tests.ci import fixtures as fx


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


def _csv(path: Path) -> None:
    case = {"id": "decode/nsa_decode/auto/x", "suite": "decode", "op": "nsa_decode", "backend": "auto",
            "status": "ok", "params": {"B": 8, "T": 8192, "Hq": 64, "Hkv": 4, "Dk": 128, "Dv": 128},
            "timing": {"median_ms": 0.1}}
    decode.write_csv([case], path)


def _config(path: Path) -> None:
    config_edit.apply_to_file(path, "sm90", {"fa2_min_len_win": 2048})


WRITERS: dict[str, Callable[[Path], object]] = {
    "ci.atomic.write_text": lambda p: atomic.write_text(p, "new\n"),
    "ci.history_store (a record)": lambda p: history_store._atomic_write(p, "new\n"),
    "ci.config_edit.apply_to_file": _config,
    "bench decode.write_csv": _csv,
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_hard_linked_target_is_replaced_not_written_through(tmp_path: Path, writer: str) -> None:
    """Issue 34: a hard link in an output folder to a file elsewhere (a config, a credentials file) must
    not have that file rewritten by the next run."""
    old = fx.pristine_config_text() if writer == "ci.config_edit.apply_to_file" else "old\n"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text(old, encoding="utf-8")
    target = tmp_path / "out" / "file"
    target.parent.mkdir()
    os.link(elsewhere, target)
    WRITERS[writer](target)
    assert elsewhere.read_text(encoding="utf-8") == old and elsewhere.stat().st_nlink == 1
    assert target.stat().st_nlink == 1 and target.read_text(encoding="utf-8") != old
    assert sorted(p.name for p in target.parent.iterdir()) == ["file"]  # no temporary file left
