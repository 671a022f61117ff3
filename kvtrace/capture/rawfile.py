"""Raw event files: the ring buffer's records as they arrived (u32 length + bytes each).

``kvtrace attach --raw-out FILE`` writes one; tests decode recorded files without root,
and a bug report can carry one.
"""
from __future__ import annotations

import errno
import struct
from typing import BinaryIO

from kvtrace.dataset.writer import private_open
from kvtrace.errors import OutputError

LEN = struct.Struct("<I")


def create(path) -> BinaryIO:
    """Open path for writing, empty, mode 0600 like the dataset's files (writer.private_open)."""
    try:
        return private_open(path, "wb")
    except OSError as e:
        raise OutputError(f"cannot write --raw-out {path}: {e.strerror}; choose another file") from None


def append(f: BinaryIO, batch: dict[int, list[bytes]]) -> None:
    try:
        for records in batch.values():
            for r in records:
                f.write(LEN.pack(len(r)))
                f.write(r)
        f.flush()
    except OSError as e:
        what = "disk full" if e.errno == errno.ENOSPC else e.strerror
        raise OutputError(f"cannot write the --raw-out file: {what}; the records written before stay readable") from None


def read(path) -> dict[int, list[bytes]]:
    """Records of a raw file grouped by kind; a truncated tail is ignored."""
    out: dict[int, list[bytes]] = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 4 <= len(data):
        (n,) = LEN.unpack_from(data, pos)
        rec = data[pos + 4:pos + 4 + n]
        if len(rec) < n or n == 0:
            break
        out.setdefault(rec[0] & 0xF, []).append(rec)
        pos += 4 + n
    return out
