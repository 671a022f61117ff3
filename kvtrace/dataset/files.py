"""Opening a dataset's files without trusting what is in the directory (docs/schema.md, "Reading a
dataset"): a part file is opened non-blocking and without following a link (a FIFO, a socket or a
link to a device cannot hang or redirect a command), and read only when it is a regular file."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pyarrow as pa

from kvtrace.errors import DatasetError

KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


class NotRegular(OSError):
    """A dataset file that is not a regular file (its ``why`` says what it is)."""

    def __init__(self, why: str):
        super().__init__(errno.EINVAL, why)
        self.why = why


def _kind(mode: int) -> str:
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def open_regular(path: Path) -> pa.NativeFile:
    """``path`` opened for reading by Arrow if it is a regular file; NotRegular if not (a link is
    not followed: kvtrace writes none); OSError as open(2) gives it.

    The file checked is the file read: Arrow opens it again through /proc/self/fd (its own I/O,
    threads and all; a Python file object under Arrow's reader can abort the interpreter at exit).
    Without /proc, the checked descriptor as a Python file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegular("not a regular file (a symbolic link: kvtrace does not follow links in a dataset)") from None
        if e.errno == errno.ENXIO:
            raise NotRegular("not a regular file (a socket or a device without a driver)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(f"not a regular file ({_kind(mode)})")
    try:
        f = pa.OSFile(f"/proc/self/fd/{fd}")
    except OSError:
        return pa.PythonFile(os.fdopen(fd, "rb"), mode="r")
    os.close(fd)
    return f


def shown(path, limit: int = 160) -> str:
    """A path for a one-line message: whole, or its start and end around an ellipsis."""
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}…{text[-limit // 2:]} ({len(text.encode())} bytes)"


def check_root(root: Path) -> None:
    """DatasetError (exit 6) unless root is a directory; one line for every way it is not
    (missing, a file, a name over the system's limits, no permission)."""
    try:
        mode = os.stat(root).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise DatasetError(f"no dataset at {shown(root)}: give the --out directory of a kvtrace attach") from None
    except OSError as e:
        raise DatasetError(f"cannot open dataset {shown(root)}: {e.strerror}") from None
    if not stat.S_ISDIR(mode):
        raise DatasetError(f"{shown(root)} is not a directory: give the --out directory of a kvtrace attach")
