"""Read a BPF ring buffer straight from its memory map, records in bulk.

bcc's ring_buffer_poll() calls a Python callback through ctypes for every record, which
caps a Python consumer near 150-200k events/s here.  The ring buffer's memory is mappable
(kernel/bpf/ringbuf.c): page 0 holds the consumer position (read-write), page 1 the
producer position, followed by the data area, which the kernel lets user space map twice so
a record that wraps reads contiguously.  This reader maps it once (the second mapping would
double the ring's share of the agent's resident memory once the reader has wrapped) and joins
the two pieces of a pass that wraps.  Each record has an 8-byte header: u32 length with a busy bit (still being
written) and a discard bit, then the record, padded to 8 bytes.  This reader copies all
committed records in one pass and advances the consumer position once per pass, as
libbpf's ring_buffer__consume does.

A copy taken while the kernel commits records is not ordered: glibc's memcpy loads the tail
of a large block first, so a record committed during the copy can come out with its header
(committed) newer than its data (not yet written).  Records do not change once committed
until the consumer position moves past them, so the committed part is copied a second time
and compared; where they differ, the second copy, taken after every header was seen
committed, is the one decoded.
"""
from __future__ import annotations

import mmap
import select
import struct

import numpy as np

BUSY = 1 << 31
DISCARD = 1 << 30
HDR = 8
PAGE = mmap.PAGESIZE
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")


class RingReader:
    torn = 0   # passes whose first copy caught a record mid-commit (decoded from the second)

    def __init__(self, map_fd: int, data_size: int):
        if data_size & (data_size - 1):
            raise ValueError("ring buffer size must be a power of two")
        self.size = data_size
        self.mask = data_size - 1
        self.cons = mmap.mmap(map_fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod = mmap.mmap(map_fd, PAGE + data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=PAGE)
        self.poller = select.poll()
        self.poller.register(map_fd, select.POLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Sleep until the kernel signals new data (or the timeout); returns at once if data is pending."""
        if U64.unpack_from(self.prod, 0)[0] == U64.unpack_from(self.cons, 0)[0]:
            self.poller.poll(timeout_ms)

    def read(self, sink: dict[int, list[bytes]], limit: int) -> int:
        """Append committed records to sink[kind] (kind = first byte & 0xF); returns how many.

        A run of same-sized records of one kind (the usual case at high rates) is cut out
        with numpy in one step and appended as one bytes object holding the records back
        to back; a lone record is appended on its own.  Decoders accept both.
        """
        cons = U64.unpack_from(self.cons, 0)[0]
        prod = U64.unpack_from(self.prod, 0)[0]
        if cons == prod:
            return 0
        chunk = self._copy(cons, prod - cons)
        out: dict[int, list[bytes]] = {}
        n, pos = self._walk(chunk, out, limit)
        if pos:
            again = self._copy(cons, pos)
            if memoryview(chunk)[:pos] != again:   # a record committed during the first copy
                self.torn += 1
                out = {}
                n, pos = self._walk(again, out, limit)
            for kind, recs in out.items():
                sink.setdefault(kind, []).extend(recs)
            U64.pack_into(self.cons, 0, cons + pos)
        return n

    def _copy(self, cons: int, length: int) -> bytes:
        """length bytes of the data area from consumer position cons (joined where they wrap)."""
        base = PAGE + (cons & self.mask)
        end = PAGE + self.size
        if base + length <= end:
            return self.prod[base:base + length]  # one copy
        return self.prod[base:end] + self.prod[PAGE:PAGE + base + length - end]

    def _walk(self, chunk: bytes, sink: dict[int, list[bytes]], limit: int) -> tuple[int, int]:
        """Records of chunk up to the first uncommitted one (or limit): (how many, bytes used)."""
        avail = len(chunk)
        view = np.frombuffer(chunk, dtype=np.uint8)
        n = pos = 0
        unpack = U32.unpack_from
        cooldown = 0
        while pos + HDR <= avail and n < limit:
            (length,) = unpack(chunk, pos)
            if length & BUSY:
                break
            size = length & ~(BUSY | DISCARD)
            stride = (size + HDR + 7) & ~7
            if pos + stride > avail:   # only in a second copy cut at a committed record's end
                break
            if not cooldown and not length & DISCARD and size and avail - pos >= 32 * stride:
                m = self._run(chunk, pos, length, stride, min(limit - n, (avail - pos) // stride))
                if m >= 16:
                    rows = view[pos:pos + m * stride].reshape(m, stride)[:, HDR:HDR + size]
                    sink.setdefault(chunk[pos + HDR] & 0xF, []).append(rows.tobytes())
                    n += m
                    pos += m * stride
                    continue
                cooldown = 64
            if cooldown:
                cooldown -= 1
            if not length & DISCARD:
                rec = chunk[pos + HDR:pos + HDR + size]
                sink.setdefault(rec[0] & 0xF, []).append(rec)
                n += 1
            pos += stride
        return n, pos

    @staticmethod
    def _run(chunk: bytes, pos: int, length: int, stride: int, most: int) -> int:
        """How many records from pos on share this header word and kind byte, at this stride."""
        if stride % 4:
            return 0
        words = np.frombuffer(chunk, dtype="<u4", count=most * stride // 4, offset=pos)
        heads = words[:: stride // 4]
        kinds = np.frombuffer(chunk, dtype=np.uint8, count=most * stride, offset=pos)[HDR::stride]
        same = (heads == length) & (kinds == chunk[pos + HDR])
        bad = np.flatnonzero(~same)
        return int(bad[0]) if bad.size else most

    def close(self) -> None:
        self.cons.close()
        self.prod.close()
