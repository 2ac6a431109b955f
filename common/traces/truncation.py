"""A spans file truncated in place while explain reads it (logrotate's copytruncate, ``: > FILE``): the same open
file, so nothing by name or identity tells it (common/spans_file.open_rotated does not), and the writers' O_APPEND
goes on at its new end. A read went on past the end (nothing more), or, once the file had grown again, from the
middle of other lines; the second pass found none of the first pass's lines. It is told here by the file being
shorter than what was already read of it, or by its first bytes no longer being those read at first (truncated,
then written past where the reader was); a file that was shorter than those bytes at first (empty: just rotated or
cut) has them kept again once a check has passed.

It is not exact, and no cheap check is: a cut in place keeps the inode, the size can end larger than what was read,
and mtime and ctime move at each append as they do at a cut; only all the bytes read, compared again, would tell a
cut that left the first ones as they were (a partial ``truncate -s``, not logrotate's cut to nothing)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TextIO

_HEAD_BYTES = 4096  # what is compared of a file's start: a batch line's ids and times, in its first hundred bytes


class FileTruncated(Exception):
    """``path`` was truncated in place while it was read; ``read``: the texts read of the files before it was told
    (spans the files held then, but a line the truncation cut may be among them)."""

    def __init__(self, path: Path, read: list[str]) -> None:
        super().__init__(f"{path} was truncated while it was read")
        self.path = path
        self.read = read


class TruncationWatch:
    """What has been read of each open file, over every pass of one reading: ``begin`` before each read of a file
    from its start, ``check`` after it (raises FileTruncated). Pipes and other files that cannot be truncated are not
    watched."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, bytes]] = {}  # fd -> (offset read up to, the file's first bytes then)

    def begin(self, f: TextIO) -> None:
        fd = _regular_fd(f)
        if fd is not None and fd not in self._seen:
            self._seen[fd] = (0, os.pread(fd, _HEAD_BYTES, 0))

    def check(self, path: Path, f: TextIO, read: list[str]) -> None:
        fd = _regular_fd(f)
        if fd is None or fd not in self._seen:
            return
        reach, head = self._seen[fd]
        # The kernel's offset is what the buffered reader took from the file: the text layer's tell() is not.
        reach = max(reach, os.lseek(fd, 0, os.SEEK_CUR))
        self._seen[fd] = (reach, head)
        if os.fstat(fd).st_size < reach or os.pread(fd, len(head), 0) != head:
            raise FileTruncated(path, read)
        if len(head) < min(reach, _HEAD_BYTES):
            # Kept when the file was shorter (empty, just rotated or cut): those bytes matched whatever it held later.
            # What it holds now was read by the pass just checked.
            self._seen[fd] = (reach, os.pread(fd, min(reach, _HEAD_BYTES), 0))


def _regular_fd(f: TextIO) -> int | None:
    try:
        fd = f.fileno()
        return fd if f.seekable() and stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError):  # io.StringIO and the like: no file under it
        return None
