"""The ring reader never decodes a record from a copy taken while it was being committed.

glibc's memcpy loads the tail of a large block first, so the copy of a record committed during
the copy can hold the new header (committed) and the old data.  A forced ring overflow under
CI load once decoded such a record: one event missing, one garbage row in its place.  Here the
first copy of the ring is torn that way on purpose; the reader must hand out the records as
they were committed, and say it saw a torn copy."""
from __future__ import annotations

import struct

from kvtrace.capture.ringbuf import HDR, PAGE, RingReader

SIZE = 40


class TornOnce(bytearray):
    """Ring memory whose first slice returns stale bytes at one offset, as a torn copy would."""

    stale: tuple[int, bytes] | None = None

    def __getitem__(self, key):
        out = bytes(bytearray.__getitem__(self, key))
        if isinstance(key, slice) and self.stale is not None and key.start <= self.stale[0] < key.stop:
            at, junk = self.stale
            self.stale = None
            i = at - key.start
            out = out[:i] + junk + out[i + len(junk):]
        return out


def record(i: int) -> bytes:
    return bytes([3]) + struct.pack("<I", i) + bytes(range(i % 7, i % 7 + SIZE - 5))


def ring(records: list[bytes], start: int = 0, data_size: int = 1 << 14) -> RingReader:
    r = RingReader.__new__(RingReader)
    r.size, r.mask = data_size, data_size - 1
    r.cons, r.prod = bytearray(PAGE), TornOnce(PAGE + data_size)
    pos = start
    for rec in records:
        at = PAGE + (pos & r.mask)
        struct.pack_into("<I", r.prod, at, len(rec))
        for j, b in enumerate(rec):      # byte by byte: a record may wrap
            r.prod[PAGE + ((pos + HDR + j) & r.mask)] = b
        pos += (len(rec) + HDR + 7) & ~7
    struct.pack_into("<Q", r.cons, 0, start)
    struct.pack_into("<Q", r.prod, 0, pos)
    return r


def records_of(sink) -> list[bytes]:
    out = []
    for chunk in sink.get(3, []):
        out += [chunk[i:i + SIZE] for i in range(0, len(chunk), SIZE)]
    return out


def test_a_torn_copy_is_read_again():
    recs = [record(i) for i in range(60)]
    r = ring(recs)
    stride = (SIZE + HDR + 7) & ~7
    r.prod.stale = (PAGE + 58 * stride + HDR + 1, b"\xee" * 16)   # near the tail, as memcpy loads it
    sink = {k: [] for k in range(16)}
    assert r.read(sink, 10_000) == 60
    assert records_of(sink) == recs
    assert r.torn == 1
    assert struct.unpack_from("<Q", r.cons, 0)[0] == 60 * stride


def test_a_torn_copy_that_wraps():
    recs = [record(i) for i in range(50)]
    start = (1 << 14) - 20 * ((SIZE + HDR + 7) & ~7) - 8
    r = ring(recs, start=start)
    r.prod.stale = (PAGE + 100, b"\xee" * 8)        # in the part after the wrap
    sink = {k: [] for k in range(16)}
    assert r.read(sink, 10_000) == 50
    assert records_of(sink) == recs
    assert r.torn == 1


def test_an_untorn_copy_is_read_once():
    recs = [record(i) for i in range(30)]
    sink = {k: [] for k in range(16)}
    r = ring(recs)
    assert r.read(sink, 10_000) == 30 and records_of(sink) == recs and r.torn == 0
