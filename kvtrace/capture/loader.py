"""The kernel side: compile the plan with bcc, fill the target set, poll the ring buffer.

The only module that imports bcc.  Events are copied out of the ring buffer as raw bytes
and sorted by kind; decoding happens later, in batches, in kvtrace.attach.pipeline.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading
import time

from kvtrace import phases
from kvtrace.capture import events, progstats
from kvtrace.capture.memory import release_compiler_memory
from kvtrace.capture.program import Plan
from kvtrace.capture.ringbuf import RingReader
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


class _NoPandas:
    """An import finder that refuses pandas (see keep_pandas_out)."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("pandas is kept out of a running capture")
        return None


_NO_PANDAS = _NoPandas()


def keep_pandas_out() -> bool:
    """pyarrow imports pandas (≈37 MB resident here) the first time ``pa.table()`` checks
    whether its input is a DataFrame; a capture never uses pandas.  Until ``let_pandas_in``,
    importing pandas fails (pyarrow then takes it as not installed), unless it is already
    imported.  True when this call kept it out."""
    if "pandas" in sys.modules or _NO_PANDAS in sys.meta_path:
        return False
    sys.meta_path.insert(0, _NO_PANDAS)
    return True


def let_pandas_in() -> None:
    try:
        sys.meta_path.remove(_NO_PANDAS)
    except ValueError:
        pass


READ_EVERY_MS = 50  # the reader's timer; the kernel wakes it sooner only when it falls behind


def name_thread(name: bytes) -> None:
    """Set the calling thread's name (prctl PR_SET_NAME; at most 15 bytes), where libc allows."""
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Source:
    """The ring buffer as a source of raw events, grouped by kind, with bounded memory."""

    def __init__(self, plan: Plan, max_pending: int = 4_000_000):
        bpf_cls = _import_bcc()
        build = f"/lib/modules/{platform.release()}/build"
        if not os.environ.get("BCC_KERNEL_SOURCE") and not os.path.exists(build):
            raise CaptureError(f"no kernel headers at {build}: run scripts/setup-host (or set BCC_KERNEL_SOURCE)")
        phases.mark("bpf_start")
        try:
            self.bpf = bpf_cls(text=plan.text, cflags=plan.cflags)
        except Exception as e:
            raise CaptureError(f"the BPF program did not compile or load ({e}); run `kvtrace doctor`") from None
        phases.mark("bpf_loaded")
        self.released_bytes = release_compiler_memory()
        self._pandas_blocked = keep_pandas_out()
        self.pending: dict[int, list[bytes]] = {k: [] for k in range(events.NKINDS)}
        self.count = 0
        self.max_pending = max_pending
        self.dropped = 0  # records left in the ring because the pending batch was full
        self._targets = self.bpf["targets"]
        self.ring = RingReader(self.bpf["events"].map_fd, plan.ringbuf_pages * mmap.PAGESIZE)
        self._unread = self.bpf["rb_unread"]  # bytes since the last read: the kernel wakes us past a quarter ring
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def add_target(self, pid: int) -> None:
        self._targets[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def targets(self) -> list[int]:
        return [k.value for k in self._targets.keys()]

    def start(self) -> None:
        """Read the ring buffer on a thread of its own, so decoding and writing a batch never
        leave the ring unread long enough to fill it."""
        self._thread = threading.Thread(target=self._run, name="kvtrace-ring", daemon=True)
        self._thread.start()
        phases.mark("capture_start")

    def _run(self) -> None:
        name_thread(b"kvtrace-ring")   # as top -H and /proc/PID/task/*/comm show it
        while not self._stopping.is_set():
            self.poll(READ_EVERY_MS)

    def poll(self, timeout_ms: int) -> None:
        """Wait for data (at most timeout_ms), then copy out what the kernel has committed.

        Records are submitted without a wakeup (probes/kvtrace.h), so the wait normally lasts
        the whole timeout: the reader wakes about 20 times a second however many events
        arrive, and sooner only when a quarter of the ring is unread.
        When the pending batch is full the records stay in the ring buffer; if the kernel
        then cannot reserve, it counts the loss itself, so every loss is counted once.
        """
        self.ring.wait(timeout_ms)
        with self._lock:
            room = self.max_pending - self.count
            if room > 0:
                self._read(room)
        if room <= 0:   # the batch is full until the next drain: the records wait in the ring
            time.sleep(timeout_ms / 1000)

    def _read(self, room: int) -> None:
        """Copy out what the kernel has committed; the kernel's count of unread bytes (which
        decides when it wakes the reader early, probes/kvtrace.h) starts again from zero."""
        try:
            self._unread[ctypes.c_int(0)] = ctypes.c_uint64(0)
        except Exception:   # the count only decides early wakeups: reading goes on without it
            pass
        self.count += self.ring.read(self.pending, room)

    def drain(self) -> dict[int, list[bytes]]:
        """Everything read so far, by kind; the source starts a new batch."""
        with self._lock:
            room = self.max_pending - self.count
            if room > 0:
                self._read(room)
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

    def kernel_skips(self) -> dict[str, int]:
        """Events the kernel did not run kvtrace's program for, per event, as the kernel counts
        them (kvtrace.capture.progstats; {} where it does not count)."""
        try:
            funcs = {name.decode() if isinstance(name, bytes) else name: f.fd for name, f in self.bpf.funcs.items()}
        except Exception:
            return {}
        return progstats.misses(funcs)

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(2)
        try:
            self.ring.close()
            self.bpf.cleanup()
        except Exception:
            pass
        if self._pandas_blocked:
            let_pandas_in()
