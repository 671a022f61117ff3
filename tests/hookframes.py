"""An agent for hook tests without root: a flag entry naming this process, and the hook's marker
writes received on a socket and decoded as the agent decodes them (kvtrace.capture.usermark)."""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import time

from kvtrace.capture import events, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.hook import state


def as_marker(frame: bytes) -> bytes:
    """A marker write as the usermark probe hands it to the agent."""
    head = usermark.HDR.pack(events.KIND_USER, 1, 32 + len(frame), 0, 1, 42, 43)
    return head + struct.pack("<II", len(frame), 0) + frame


@contextlib.contextmanager
def receiver(tmp_path, monkeypatch, settle: float = 0.0):
    """Yields records(): every record the hook sent so far (sent now, after ``settle`` seconds
    for a hook's own sender), decoded by table."""
    flag = tmp_path / "agents"
    flag.mkdir()
    (flag / str(os.getpid())).write_text(f"{os.getpid()}\n")
    rx, tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    rx.setblocking(False)
    monkeypatch.setattr(state.T, "flag_path", str(flag))
    monkeypatch.setattr(state.T, "mark_fd", tx.fileno())
    state.T.enabled, state.T.next_check = False, 0
    state._Q.clear()

    def records() -> dict[str, list[dict]]:
        time.sleep(settle)
        state._flush(time.monotonic_ns())
        frames = []
        while True:
            try:
                frames.append(as_marker(rx.recv(1 << 16)))
            except BlockingIOError:
                return usermark.records(frames, DecodeContext())

    try:
        yield records
    finally:
        state._Q.clear()
        state.T.enabled, state.T.next_check = False, 0
        rx.close()
        tx.close()
