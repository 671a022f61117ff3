"""Evictions go out batched (one `evicts` record per allocation) and come back as one `evict`
row per hash, with the hashes, groups, block ids and requests the hook was given."""
from __future__ import annotations

import struct

from kvtrace.capture import events, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.hook.vllm import engine as hook
from kvtrace.hook.wire import CODEC, EVICTS_MAX, MAGIC


class Pool:
    medium = "GPU"


def key(h: int, group: int = 0) -> bytes:
    """A BlockHashWithGroupId as vLLM builds it: 32 hash bytes, then the 4-byte group id."""
    return h.to_bytes(32, "big") + group.to_bytes(4, "big")


def as_marker(frame: bytes, ts: int) -> bytes:
    head = usermark.HDR.pack(events.KIND_USER, 1, 32 + len(frame), 0, ts, 42, 43)
    return head + struct.pack("<II", len(frame), 0) + frame


def queued() -> list[tuple]:
    out = list(hook._Q)
    hook._Q.clear()
    return out


def test_one_record_per_allocation_and_one_row_per_hash():
    hook._Q.clear()
    hook.S.reset()
    hook.S.step, hook.S.cur_req = 7, "req-a"
    hook._note_evict(Pool(), 3, key(0xAAAA_0000_0000_0001), None)
    hook._note_evict(Pool(), 4, key(0xBBBB), [key(0xCCCC, group=1)])   # a block held two hashes
    hook.S.cur_req = "req-b"                                          # the next allocation
    hook._note_evict(Pool(), 9, key(1 << 64 | 0xDDDD), None)          # only the low 64 bits count
    hook._evicts_out()
    recs = queued()
    assert [r[0] for r in recs] == ["evicts", "evicts"] and hook.S.evicted == 4 and hook.S.ev is None
    frame = MAGIC + b"".join(CODEC.encoders[r[0]](*r) for r in recs)
    rows = usermark.records([as_marker(frame, 5000)], DecodeContext())
    assert list(rows) == ["evict"]
    got = [(r["step"], r["block_hash"], r["group"], r["block_id"], r["medium"], r["request"], r["mark_ns"]) for r in rows["evict"]]
    assert got == [(7, 0xAAAA_0000_0000_0001, 0, 3, "GPU", "req-a", 5000), (7, 0xBBBB, 0, 4, "GPU", "req-a", 5000),
                   (7, 0xCCCC, 1, 4, "GPU", "req-a", 5000), (7, 0xDDDD, 0, 9, "GPU", "req-b", 5000)]
    first, second = (r for r in recs)
    assert [r["t_ns"] for r in rows["evict"]] == [first[2]] * 3 + [second[2]]
    assert usermark.schema_for("evict").names[:7] == ["step", "t_ns", "block_hash", "group", "block_id", "medium", "request"]


def test_a_full_batch_starts_another_that_still_fits_a_frame():
    hook._Q.clear()
    hook.S.reset()
    hook.S.step, hook.S.cur_req = 1, "r" * 64
    for i in range(EVICTS_MAX + 5):
        hook._note_evict(Pool(), i, key(i + 1), None)
    hook._evicts_out()
    recs = queued()
    assert [len(r[5]) // 2 for r in recs] == [EVICTS_MAX, 5]
    assert all(len(MAGIC) + len(CODEC.encoders["evicts"](*r)) <= 4000 for r in recs)
    frames = [as_marker(MAGIC + CODEC.encoders["evicts"](*r), 1) for r in recs]
    rows = usermark.records(frames, DecodeContext())["evict"]
    assert [r["block_id"] for r in rows] == list(range(EVICTS_MAX + 5)) and [r["block_hash"] for r in rows] == list(range(1, EVICTS_MAX + 6))


def test_older_hooks_single_evict_records_still_decode():
    frame = MAGIC + CODEC.encode("evict", 2, 10, 0xFEED, 0, 5, "GPU", "req")
    (row,) = usermark.records([as_marker(frame, 9)], DecodeContext())["evict"]
    assert (row["block_hash"], row["block_id"], row["request"]) == (0xFEED, 5, "req")
