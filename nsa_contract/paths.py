"""Checks of the paths a command reads or writes, run before it touches a file, and file-system
faults as one line.

Each check raises `InputError` (exit 2, `nsa_contract.exits.BAD_INPUT`) with
`"<name> must <constraint>, got <actual>; <fix>"`, so that a bad path is reported in one line
before a file is touched, not as a traceback halfway through a sweep or a stage;
`file_system_error` says the same of an OSError met later (a full disk, `ulimit -f`, a read-only
folder). `python -m bench` and every `python -m ci` subcommand use them. Standard library only
(PyYAML in `check_yaml_file`, imported there).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["InputError", "check_out_dir", "check_out_file", "check_text_file", "check_yaml_file",
           "file_system_error"]


class InputError(ValueError):
    """A command-line value that cannot work; the message says how to fix it."""


def check_text_file(path: str | os.PathLike[str], flag: str, fix: str) -> None:
    """`path` is a readable UTF-8 text file."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} must be a file, got the folder {str(p)!r}; {fix}")
    try:
        p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"{flag} must be a readable file, got {str(p)!r} ({exc.strerror}); {fix}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{flag} must be UTF-8 text, got {str(p)!r} with a byte {exc.object[exc.start]:#04x} "
                         f"that is not UTF-8 at offset {exc.start}; save it as UTF-8 or {fix}") from None


def check_yaml_file(path: str | os.PathLike[str], flag: str, fix: str) -> None:
    """`path` is a readable UTF-8 file that parses as YAML (what it must contain is the reader's business)."""
    check_text_file(path, flag, fix)
    import yaml  # PyYAML: imported by the subcommands that read configs, never by `guard`

    try:
        yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise InputError(f"{flag} must be valid YAML, got {problem}{where} in {str(path)!r}; fix that line "
                         f"or {fix}") from None


def check_out_dir(path: str | os.PathLike[str], flag: str, *, replaced: bool = False, writable: bool = True) -> None:
    """`path` is a folder or does not exist yet (it is created), never a file, and can be written.

    `replaced`: the stage swaps in a new folder as a whole (`nsa_contract.atomic.staging_dir`), so a symlink
    there would be replaced by a folder: refused, naming the folder it points to. `writable=False`
    for a folder that is only read (a dry run's history store).
    """
    p = Path(path)
    for parent in (p, *p.parents):
        if parent.is_symlink() and not parent.exists():
            raise InputError(f"{flag} must be a folder, got {str(p)!r} where {str(parent)!r} is a broken symlink; "
                             "remove the link or pass another folder")
        if parent.exists() and not parent.is_dir():
            raise InputError(f"{flag} must be a folder, got {str(p)!r} where {str(parent)!r} is a file; "
                             "pass another folder or remove the file")
    if replaced and p.is_symlink():
        raise InputError(f"{flag} must be a folder, not a symlink, got {str(p)!r} -> {os.readlink(p)!r} (this "
                         f"command replaces the folder as a whole); pass the folder itself, {str(p.resolve())!r}")
    # The folders a write needs: the nearest existing one (files go in it, or its new subfolders), and
    # for a replaced folder also the one it sits in (the new folder is made there, then renamed).
    if not writable:
        return
    needed = [next(q for q in (p, *p.parents) if q.exists())]
    if replaced:
        needed.append(next(q for q in p.parents if q.exists()))
    for folder in needed:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"{flag} must be a writable folder, got {str(p)!r} where {str(folder)!r} is not "
                             "writable (permission denied or a read-only file system); make it writable or pass "
                             "another folder")


def check_out_file(path: str | os.PathLike[str], flag: str) -> None:
    """`path` is a file or does not exist yet, never a folder, and its parents are folders."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} must be a file path, got the folder {str(p)!r}; pass a file name "
                         f"inside it, e.g. {str(p / 'out.json')!r}")
    check_out_dir(p.parent, f"the folder of {flag}")


# errno -> the fix, for the file-system faults a stage can meet while it reads or writes its files.
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
_IN_THE_WAY = (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ELOOP, errno.ENOTEMPTY)
_FS_ERRNOS = (*_FULL, *_DENIED, *_IN_THE_WAY, errno.ENOENT, errno.ENAMETOOLONG, errno.EMLINK, errno.EXDEV, errno.EIO)


def file_system_error(exc: BaseException) -> str | None:
    """`exc` as one line `"<path> ...: <cause>; <fix>"` when it is a file-system fault (a full disk,
    `ulimit -f`, permissions, a file where a folder must be), else None (a network error is an
    OSError too, and is not this).
    """
    if not isinstance(exc, OSError) or (exc.filename is None and exc.errno not in _FS_ERRNOS):
        return None
    where = repr(str(exc.filename)) if exc.filename is not None else "a file"
    if exc.filename2 is not None:
        where += f" (to {str(exc.filename2)!r})"
    cause = exc.strerror or type(exc).__name__
    if exc.errno in _FULL:
        return (f"the disk must have room for {where}, got {cause} (a full disk or a file size limit, ulimit -f); "
                "free space or raise the limit, then rerun")
    if exc.errno in _DENIED:
        return f"{where} must be writable, got {cause}; make its folder writable (chmod u+w) or pass another path"
    if exc.errno in _IN_THE_WAY:
        return (f"{where} must be a folder where a folder is needed and a file where a file is, got {cause}; "
                "remove what is in the way or pass another path")
    return f"{where} must be usable, got {cause}; check that path (or pass another one) and rerun"
