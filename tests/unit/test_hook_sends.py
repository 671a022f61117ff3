"""Frames another thread sends for the Worker name the thread that made their records: a
`thread` record heads every frame, and the agent puts its tid in the records after it."""
from __future__ import annotations

import struct

from kvtrace.capture import events, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.hook import transport
from kvtrace.hook.wire import CODEC, MAGIC, MAX_FRAME

MARKER_TID = 43   # the sender thread, as the BPF program sees it
WORKER_TID = 7001


def as_marker(frame: bytes, ts: int) -> bytes:
    head = usermark.HDR.pack(events.KIND_USER, 1, 32 + len(frame), 0, ts, 42, MARKER_TID)
    return head + struct.pack("<II", len(frame), 0) + frame


def kv_store(seq: int) -> bytes:
    return CODEC.encode("kv_store", 1000 + seq, 2000 + seq, 2000 + seq, seq, 0, 0, 0, 0, "", "connector:X")


def sent(monkeypatch, recs: list[bytes], lead: bytes) -> list[bytes]:
    writes = []
    monkeypatch.setattr(transport.os, "write", lambda fd, b: writes.append(bytes(b)) or len(b))
    transport.Transport().flush(recs, lead)
    return writes


def test_every_frame_is_headed_by_the_thread_and_its_records_carry_it(monkeypatch):
    recs = [kv_store(i) for i in range(120)]             # about 9 KB: three frames
    frames = sent(monkeypatch, recs, CODEC.encode("thread", WORKER_TID))
    assert len(frames) == 3 and all(len(f) <= MAX_FRAME for f in frames)
    assert all(CODEC.decode_frame(f)[0] == ("thread", {"tid": WORKER_TID}) for f in frames)
    rows = usermark.records([as_marker(f, 10 + i) for i, f in enumerate(frames)], DecodeContext())
    assert set(rows) == {"kv_store"}                     # the thread record is not stored
    assert [r["seq"] for r in rows["kv_store"]] == list(range(120))
    assert {r["tid"] for r in rows["kv_store"]} == {WORKER_TID}


def test_a_frame_without_it_keeps_the_writers_tid(monkeypatch):
    (frame,) = sent(monkeypatch, [kv_store(1)], b"")
    assert frame.startswith(MAGIC)
    rows = usermark.records([as_marker(frame, 5)], DecodeContext())
    assert [r["tid"] for r in rows["kv_store"]] == [MARKER_TID]


def test_the_sender_names_the_calling_thread_and_starts_again_in_a_forked_child():
    """_Later.arm() asks the kernel for a thread's id once (then from a thread-local) and starts
    its sender thread once per process: a fork resets both, so a child's frames name its own
    thread and a sender runs in it."""
    import os
    import threading

    from kvtrace.hook.vllm import worker as hook

    later = hook._Later()
    later.arm()
    assert later.started and later.tid == threading.get_native_id()
    seen = []
    t = threading.Thread(target=lambda: (later.arm(), seen.append((later.tid, threading.get_native_id()))))
    t.start()
    t.join()
    assert seen[0][0] == seen[0][1] != os.getpid()            # another thread: its own id
    pid = os.fork()
    if pid == 0:   # the child: no sender yet, no remembered id; after arm(), its own
        ok = not later.started and getattr(later.local, "tid", 0) == 0
        later.arm()
        ok = ok and later.started and later.tid == os.getpid() == threading.get_native_id()
        ok = ok and any(th.name == "kvtrace-hook-send" for th in threading.enumerate())
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_kv_step_record_gives_the_rows_its_kv_load_and_kv_store_gave():
    """Hook version 4 sends one kv_step per Worker step; the agent stores the same kv_load and
    kv_store rows the two records of earlier versions gave (and no kv_load for a step that
    loaded nothing)."""
    src = "connector:KvtraceFileConnector"
    old = [CODEC.encode("kv_load", 100, 180, 150, 5, 2, 30, 0, 0, "", src),
           CODEC.encode("kv_store", 200, 260, 260, 5, 0, 0, 0, 0, "", src),
           CODEC.encode("kv_store", 300, 310, 310, 6, 0, 0, 0, 0, "", src)]
    new = [CODEC.encode("kv_step", 100, 180, 150, 5, 2, 30, 200, 260, 1, src),
           CODEC.encode("kv_step", 0, 0, 0, 6, 0, 0, 300, 310, 0, src)]
    rows = [usermark.records([as_marker(MAGIC + b"".join(recs), 9)], DecodeContext()) for recs in (old, new)]
    assert rows[0] == rows[1]
    assert [r["seq"] for r in rows[1]["kv_load"]] == [5] and [r["seq"] for r in rows[1]["kv_store"]] == [5, 6]
    assert set(rows[1]) == {"kv_load", "kv_store"}
