"""The local spans sink (TS_SPANS_FILE) that several processes append to, and its rotation by size.

Each process appends whole batches with O_APPEND, and before each batch checks that the path still names the
file it holds open: once the launcher (scripts/up.py) has renamed a full file to FILE.1 (FILE.1 to FILE.2, ...,
the oldest beyond ``keep`` removed), every process's next batch opens a new FILE. A batch written in the instant
between the check and the rename lands in FILE.1, which is kept: explain reads FILE and its rotated ones
(rotated_files), through the files it opened (open_rotated), so that a rotation while it reads moves nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TextIO


class AppendStream:
    """A text stream for FileSpanExporter: ``flush`` writes what was written since, as one write(2) (whole lines
    from several processes do not interleave), to the file now at ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._parts: list[str] = []
        self._fd: int | None = None
        self.closed = False
        self._current()  # a path that cannot be opened fails the process's start, not its first batch

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        if not self._parts or self.closed:
            return
        data = "".join(self._parts).encode("utf-8")
        self._parts.clear()
        view = memoryview(data)
        fd = self._current()
        while view:
            view = view[os.write(fd, view):]

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _current(self) -> int:
        """The open file, reopened when the path names another one (rotated) or none."""
        if self._fd is not None:
            try:
                held, named = os.fstat(self._fd), os.stat(self.path)
                if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                    return self._fd
            except FileNotFoundError:
                pass
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return self._fd


def rotate(path: str | os.PathLike, max_bytes: int, keep: int) -> bool:
    """Rename ``path`` to ``path``.1 (shifting the older ones, at most ``keep`` kept) when it holds ``max_bytes``
    or more; whether it did. One rotating process only (the launcher): the writers just follow."""
    path = Path(path)
    try:
        st = path.stat()
        if max_bytes <= 0 or not stat.S_ISREG(st.st_mode) or st.st_size < max_bytes:
            return False  # /dev/null, a pipe: nothing to rotate
        keep = max(1, keep)
        prune(path, keep - 1)  # FILE.keep makes room; FILE.keep+1.. a run that kept more left
        for n in range(keep - 1, 0, -1):
            older = Path(f"{path}.{n}")
            if older.exists():
                older.replace(f"{path}.{n + 1}")
        path.replace(f"{path}.1")
    except OSError:  # gone meanwhile, or a folder we may not rename in: the spans go on growing, the cluster runs
        return False
    return True


def prune(path: str | os.PathLike, keep: int) -> None:
    """Remove ``path``'s rotated files beyond ``keep`` (FILE.N, N > keep): a run with a higher --spans-keep left them,
    and rotate's shift never reaches them again."""
    path = Path(path)
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        n = name[len(path.name) + 1:] if name.startswith(path.name + ".") else ""
        if n.isascii() and n.isdigit() and int(n) > keep:
            try:
                Path(path.parent, name).unlink(missing_ok=True)
            except OSError:  # a folder of that name, say: not ours, and no reason to stop rotating
                pass


def rotated_files(path: str | os.PathLike) -> list[Path]:
    """``path`` and its rotated files that exist, oldest first (FILE.N, ..., FILE.1, FILE)."""
    path = Path(path)
    rotated = []
    n = 1
    while Path(f"{path}.{n}").is_file():
        rotated.append(Path(f"{path}.{n}"))
        n += 1
    return list(reversed(rotated)) + ([path] if path.exists() or not rotated else [])


def open_rotated(path: str | os.PathLike, tries: int = 5) -> tuple[list[tuple[Path, TextIO]], bool]:
    """``path`` and its rotated files (rotated_files), open, oldest first; whether they are one state of the files.

    A reader that reads the files more than once (explain's two passes) reads them through these: by name, a rotation
    between two reads made FILE.1 what had been FILE, and what had been FILE.1 read by neither. A rotation while they
    are opened is told by the names no longer naming the files open once all are; they are opened again then, and
    after ``tries`` those last opened come back with False (some spans may be missing: the caller says so).
    Raises OSError when they cannot be opened (FileNotFoundError: there is no such file)."""
    tries = max(1, tries)
    for attempt in range(1, tries + 1):
        files: list[tuple[Path, TextIO]] = []
        try:
            for p in rotated_files(path):
                files.append((p, p.open(encoding="utf-8", errors="replace")))
        except FileNotFoundError:  # renamed or removed (pruned) between the listing and its opening
            _close(files)
            if attempt == tries:
                raise
            continue
        except BaseException:
            _close(files)
            raise
        try:
            same = _identities(path) == [_identity(os.fstat(f.fileno())) for _, f in files]
        except OSError:  # one renamed away meanwhile
            same = False
        if same or attempt == tries:
            return files, same
        _close(files)
    raise FileNotFoundError(path)  # not reached: the last try returns or raises


def _identities(path: str | os.PathLike) -> list[tuple[int, int]]:
    return [_identity(p.stat()) for p in rotated_files(path)]


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _close(files: list[tuple[Path, TextIO]]) -> None:
    for _, f in files:
        f.close()
