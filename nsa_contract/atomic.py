"""Atomic file writes: a reader sees the old file or the new one, never a truncated mix.

A write goes to a temporary file in the target's own folder (so that `os.replace` is a rename on
one filesystem, which POSIX makes atomic), is flushed and fsynced, and only then replaces the
target. Any failure on the way (a full disk, `ulimit -f`, an interrupt) removes the temporary
file, and the parent folders the write created, and leaves the target as it was; an OSError that
names no file (a write that ran out of room) is given the target's path, so the CLI can name it in
its one-line error. Standard library only: `bench/` and `ci/` both write through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replace_dir", "staging_dir", "write_bytes", "write_text"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; return those created, deepest first."""
    created = [q for q in (folder, *folder.parents) if not q.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return created


def _undo(created: list[Path], exc: BaseException, path: Path) -> None:
    """After a failed write: remove the folders it created, and name `path` in an OSError that names none."""
    for folder in created:
        with contextlib.suppress(OSError):
            folder.rmdir()
    if isinstance(exc, OSError) and exc.filename is None:
        exc.filename = str(path)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically; create the parent folder; return the path."""
    p = Path(path)
    created = _make_parents(p.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as exc:
        _undo(created, exc, p)
        exc.filename = str(p)  # not the random temporary name
        raise
    try:
        # mkstemp makes the file private (0600); the target keeps the mode a plain open() gives.
        os.chmod(tmp, p.stat().st_mode & 0o7777 if p.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _undo(created, exc, p)
        raise
    return p


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically (see `write_bytes`)."""
    return write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def staging_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary folder beside `target`; on a clean exit it replaces `target` as a whole.

    Everything a stage writes goes into the yielded folder. On an exception the folder is removed
    and `target` is untouched, so a failed run never mixes its files with an earlier run's.
    """
    t = Path(target)
    created = _make_parents(t.parent)
    try:
        tmp = Path(tempfile.mkdtemp(dir=t.parent, prefix=f".{t.name}.", suffix=".tmp"))
    except OSError as exc:
        _undo(created, exc, t)
        exc.filename = str(t)  # not the random temporary name
        raise
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the target is an ordinary folder
        yield tmp
        replace_dir(tmp, t)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _undo(created, exc, t)
        raise


def replace_dir(src: Path, target: Path) -> None:
    """Put folder `src` in place of `target` (a folder or absent) with two renames.

    Two renames are not one atomic step, but between them `target` is absent, never a mix: the
    old folder is moved aside first and removed only after the new one is in place.
    """
    old = None
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise NotADirectoryError(f"{target} must be a folder, got a file; pass another folder")
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
        os.replace(target, old / target.name)
    try:
        os.replace(src, target)
    except BaseException:
        if old is not None:
            os.replace(old / target.name, target)
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
