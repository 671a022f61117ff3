"""Marker events read in bulk: the ring reader cuts a run of same-sized events of one kind in
one piece, and every frame of the run must come out (a busy hook writes runs of them)."""
from __future__ import annotations

import mmap
import struct

from kvtrace.capture import events, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.capture.ringbuf import HDR, PAGE, RingReader
from kvtrace.hook.wire import CODEC, MAGIC

SMALL = 24 + 8 + 256      # struct kv_user_small


def marker(i: int, size: int = SMALL) -> bytes:
    """One marker event as probes/usermark.bpf.c emits it: header, len, pad, the frame."""
    frame = MAGIC + CODEC.encode("hook_stats", 1000 + i, i, 0, 0, "")
    head = usermark.HDR.pack(events.KIND_USER, 1, size, 0, 5_000 + i, 42, 43)
    body = head + struct.pack("<II", len(frame), 0) + frame
    return body + b"\0" * (size - len(body))


def ring_of(records: list[bytes], data_size: int = 1 << 16) -> RingReader:
    """A RingReader over memory laid out as the kernel's ring buffer, holding ``records``."""
    r = RingReader.__new__(RingReader)
    r.size, r.mask = data_size, data_size - 1
    r.cons, r.prod = bytearray(PAGE), bytearray(PAGE + data_size)
    pos = 0
    for rec in records:
        struct.pack_into("<I", r.prod, PAGE + pos, len(rec))
        r.prod[PAGE + pos + HDR:PAGE + pos + HDR + len(rec)] = rec
        pos += (len(rec) + HDR + 7) & ~7
    struct.pack_into("<Q", r.prod, 0, pos)
    return r


def test_every_frame_of_a_run_is_decoded():
    sink = {k: [] for k in range(events.NKINDS)}
    assert ring_of([marker(i) for i in range(40)]).read(sink, 10_000) == 40
    assert len(sink[events.KIND_USER]) < 40          # the reader did cut a run in one piece
    ctx = DecodeContext()
    stats = usermark.records(sink[events.KIND_USER], ctx)["hook_stats"]
    assert [s["emitted"] for s in stats] == list(range(40))
    assert [s["mark_ns"] for s in stats] == [5_000 + i for i in range(40)]
    assert ctx.malformed == ctx.bad_frames == 0


def test_mixed_sizes_and_a_cut_piece():
    sink = {k: [] for k in range(events.NKINDS)}
    recs = [marker(i) for i in range(20)] + [marker(20, 24 + 8 + 1024)] + [marker(i) for i in range(21, 60)]
    ring_of(recs).read(sink, 10_000)
    ctx = DecodeContext()
    stats = usermark.records(sink[events.KIND_USER] + [marker(99)[:100]], ctx)["hook_stats"]
    assert [s["emitted"] for s in stats] == list(range(60))
    assert ctx.malformed == 1                          # the cut piece: counted, not decoded
    assert mmap.PAGESIZE == PAGE
