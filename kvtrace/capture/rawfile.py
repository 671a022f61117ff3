"""Raw event files: the ring buffer's records as they arrived (u32 length + bytes each).

``kvtrace attach --raw-out FILE`` writes one; tests decode recorded files without root,
and a bug report can carry one.
"""
from __future__ import annotations

import struct
from typing import BinaryIO

LEN = struct.Struct("<I")


def append(f: BinaryIO, batch: dict[int, list[bytes]]) -> None:
    for records in batch.values():
        for r in records:
            f.write(LEN.pack(len(r)))
            f.write(r)
    f.flush()


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
