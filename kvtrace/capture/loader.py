"""The kernel side: compile the plan with bcc, fill the target set, poll the ring buffer.

The only module that imports bcc.  Events are copied out of the ring buffer as raw bytes
and sorted by kind; decoding happens later, in batches, in kvtrace.pipeline.
"""
from __future__ import annotations

import ctypes
import os
import platform

from kvtrace.capture import events
from kvtrace.capture.program import Plan
from kvtrace.errors import CaptureError

BPF = None


def _import_bcc():
    global BPF
    if BPF is None:
        try:
            from bcc import BPF as _BPF
        except Exception as e:
            raise CaptureError(
                f"cannot import bcc ({e}): apt-get install python3-bpfcc and run kvtrace from /usr/bin/python3 "
                "or a venv made with --system-site-packages"
            ) from None
        BPF = _BPF
    return BPF


class Source:
    """The ring buffer as a source of raw events, grouped by kind, with bounded memory."""

    def __init__(self, plan: Plan, max_pending: int = 4_000_000):
        bpf_cls = _import_bcc()
        build = f"/lib/modules/{platform.release()}/build"
        if not os.environ.get("BCC_KERNEL_SOURCE") and not os.path.exists(build):
            raise CaptureError(f"no kernel headers at {build}: run scripts/setup-host (or set BCC_KERNEL_SOURCE)")
        try:
            self.bpf = bpf_cls(text=plan.text, cflags=plan.cflags)
        except Exception as e:
            raise CaptureError(f"the BPF program did not compile or load ({e}); run `kvtrace doctor`") from None
        self.pending: dict[int, list[bytes]] = {k: [] for k in range(events.NKINDS)}
        self.count = 0
        self.max_pending = max_pending
        self.dropped = 0  # user-space drops (pending queue full)
        self._string_at = ctypes.string_at
        self._targets = self.bpf["targets"]
        self.bpf["events"].open_ring_buffer(self._on_event)

    def _on_event(self, ctx, data, size):
        if self.count >= self.max_pending:
            self.dropped += 1
            return
        raw = self._string_at(data, size)
        self.pending[raw[0] & 0xF].append(raw)
        self.count += 1

    def add_target(self, pid: int) -> None:
        self._targets[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def targets(self) -> list[int]:
        return [k.value for k in self._targets.keys()]

    def poll(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def drain(self) -> dict[int, list[bytes]]:
        """Everything read so far, by kind; the source starts a new batch."""
        self.bpf.ring_buffer_consume()
        out = {k: v for k, v in self.pending.items() if v}
        self.pending = {k: [] for k in range(events.NKINDS)}
        self.count = 0
        return out

    def lost(self) -> dict[int, int]:
        """Failed ring-buffer reserves per kind, summed over CPUs (exact, counted in the kernel)."""
        table = self.bpf["lost"]
        out = {}
        for k in range(events.NKINDS):
            total = sum(table.getvalue(ctypes.c_int(k)))
            if total:
                out[k] = int(total)
        return out

    def close(self) -> None:
        try:
            self.bpf.cleanup()
        except Exception:
            pass
