"""NIC and RDMA counters, polled: RDMA port counters and hw_counters from sysfs, ethtool
statistics (pyroute2's IoctlEthtool) and link stats64 (pyroute2 netlink), turned into deltas.

Units and widths (drivers/infiniband/core/sysfs.c, hw/mlx5/counters.c, sw/rxe/rxe_hw_counters.c):

* ``ports/N/counters/port_{xmit,rcv}_data`` count 4-byte words: kvtrace multiplies by 4.
  The PMA error counters are 16, 8 or 4 bits wide and *saturate* (stop at all ones); the
  data/packet counters are 32 bits (saturating) or 64 bits with the extended PMA set.
* mlx5 ``hw_counters`` from Q counters (out_of_sequence, packet_seq_err,
  local_ack_timeout_err, ...) are 32-bit and *wrap*; congestion counters (np_cnp_sent,
  rp_cnp_handled, np_ecn_marked_roce_packets, ...) are 64-bit.  rxe counters are 64-bit.
* ethtool and link stats64 counters are 64-bit.

A delta is never negative: a 32-bit wrapping counter that went down wrapped (delta across
the wrap); a 64-bit counter that went down was reset (device re-created, counters cleared):
no delta, status ``reset``, the new value is the baseline.  Unreadable or non-numeric
values (``N/A (no PMA)``, EIO while the device resets) give status ``garbage``/``error`` and
keep the last good value as the baseline.  A device or counter that disappears gives
``vanished`` rows; one that appears, ``first`` rows.

The pieces, each re-exported here (``kvtrace.fabric.counters`` stays the one import):
kvtrace.fabric.counterspec (specs, ``step()``, ``Batch``), kvtrace.fabric.rdma (sysfs reader,
``ib_devices``), kvtrace.fabric.netdev (ethtool and link stats64 readers) and
kvtrace.fabric.deltas (delta state, rows, ``to_table``); the poller is in this module.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter

import pyarrow as pa

from kvtrace.fabric.counterspec import (HW_BYTES, HW_PACKETS, HW_SKIP, MLX5_Q32, PMA, PMA_EXT, U32, U64, WORDS,
                                        Batch, Spec, hw_spec, make_batch, parse_value, pma_spec, step)
from kvtrace.fabric.deltas import (COLS, ST_ERROR, ST_FIRST, ST_GARBAGE, ST_OK, ST_RESET, ST_SAT, ST_WRAP, STATUS,
                                   TABLE, Deltas, to_table, total)
from kvtrace.fabric.netdev import LINK_UNITS, EthtoolStats, LinkStats, ethtool_unit
from kvtrace.fabric.rdma import IB_CLASS, RdmaCounters, ib_devices, rdma_netdevs

__all__ = [
    "HW_BYTES", "HW_PACKETS", "HW_SKIP", "MLX5_Q32", "PMA", "PMA_EXT", "U32", "U64", "WORDS",
    "Batch", "Spec", "hw_spec", "make_batch", "parse_value", "pma_spec", "step",
    "COLS", "ST_ERROR", "ST_FIRST", "ST_GARBAGE", "ST_OK", "ST_RESET", "ST_SAT", "ST_WRAP", "STATUS",
    "TABLE", "Deltas", "to_table", "total",
    "LINK_UNITS", "EthtoolStats", "LinkStats", "ethtool_unit",
    "IB_CLASS", "RdmaCounters", "ib_devices", "rdma_netdevs",
    "NicPoller",
]


def _setns(netns: str) -> None:
    """Move the calling thread into a named network namespace (/run/netns/NAME)."""
    import ctypes

    path = netns if netns.startswith("/") else f"/run/netns/{netns}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NicPoller:
    """A pipeline sidecar: polls RDMA counters and ethtool statistics every ``interval``
    seconds and link stats64 every ``link_interval`` seconds on its own thread, and hands
    their rows over per flush (``drain``).  (A netlink request costs about 0.3 ms of CPU per
    interface in pyroute2, sysfs about 1.5 us per counter: link stats are polled less often.)

    Rows are written for counters that moved or changed status; every ``full_every``
    seconds (and at the first and last poll) every counter is written (``full``), so sums of
    deltas over any window are exact and the absolute values are never far away.
    """

    name = TABLE

    def __init__(self, interval: float = 0.1, rdma: bool = True, ifaces: list[str] | None = None,
                 ethtool: bool = True, link: bool = True, netns: str | None = None, root: str = "/",
                 full_every: float = 10.0, link_interval: float = 1.0, max_queue: int = 100000):
        if interval <= 0 or link_interval <= 0:
            raise ValueError("intervals must be positive")
        self.interval = interval
        self.link_every = max(1, round(link_interval / interval))
        self.netns = netns
        self.full_every = full_every
        self.rdma = RdmaCounters(root) if rdma else None
        self.ifaces = list(ifaces or [])
        self.eth = EthtoolStats(self.ifaces) if ethtool and self.ifaces else None
        self.link = LinkStats(self.ifaces) if link and self.ifaces else None
        self.deltas = Deltas()
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.c = Counter()
        self.cpu_s = 0.0
        self.last_full = 0
        self.error: str | None = None

    def poll_once(self, full: bool | None = None) -> None:
        t0 = time.thread_time()
        ts = time.monotonic_ns()
        if full is None:
            full = self.c["polls"] == 0 or ts - self.last_full >= self.full_every * 1e9
        if full:
            self.last_full = ts
        batches: list[Batch] = []
        if self.rdma is not None:
            batches.append(self.rdma.poll())
        if self.eth is not None:
            batches.extend(self.eth.poll())
        if self.link is not None and (full or self.c["polls"] % self.link_every == 0):
            batches.extend(self.link.poll())
        cols = {c: [] for c in COLS}
        counts = self.deltas.rows(batches, ts, full, cols)
        with self._lock:
            self.c["polls"] += 1
            self.c["samples"] += sum(len(b.keys) for b in batches)
            self.c["rows"] += len(cols["ts_ns"])
            for k in ("wrap", "reset", "garbage", "error", "vanished", "saturated"):
                self.c["status_" + k] += counts.get(k, 0)
            self.cpu_s += time.thread_time() - t0
        if cols["ts_ns"]:
            try:
                self._q.put_nowait(cols)
            except queue.Full:
                self.c["queue_drops"] += 1

    def start(self) -> list[str]:
        """Poll once now (so a bad interface or netns is reported at once), then the thread."""
        warnings = []
        ready = threading.Event()

        def run():
            try:
                if self.netns:
                    _setns(self.netns)
                self.poll_once(full=True)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
            ready.set()
            if self.error:
                return
            nxt = time.monotonic() + self.interval
            while not self._stop.wait(max(0.0, nxt - time.monotonic())):
                try:
                    self.poll_once()
                except Exception as e:  # never take capture down
                    self.c["internal_errors"] += 1
                    self.error = f"{type(e).__name__}: {e}"
                nxt += self.interval
                if nxt < time.monotonic():
                    self.c["late"] += 1
                    nxt = time.monotonic() + self.interval
            try:
                self.poll_once(full=True)   # the end state, complete
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
            self._close_readers()

        self._thread = threading.Thread(target=run, name="kvtrace-nic", daemon=True)
        self._thread.start()
        ready.wait(30)
        if self.error:
            warnings.append(f"NIC counters: {self.error}")
        for ifname, why in (self.eth.unsupported.items() if self.eth else ()):
            warnings.append(f"NIC counters: {ifname}: {why}")
        return warnings

    def _close_readers(self) -> None:
        for r in (self.rdma, self.eth, self.link):
            if r is not None:
                r.close()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    stop = close

    def drain(self) -> dict[str, pa.Table]:
        cols = {c: [] for c in COLS}
        while True:
            try:
                chunk = self._q.get_nowait()
            except queue.Empty:
                break
            for c in COLS:
                cols[c].extend(chunk[c])
        return {TABLE: to_table(cols)} if cols["ts_ns"] else {}

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.c)
            out.update(interval_s=self.interval, link_interval_s=self.interval * self.link_every, cpu_s=round(self.cpu_s, 4), netns=self.netns, ifaces=self.ifaces,
                       rdma_devices=sorted(self.rdma.devices) if self.rdma else [], error=self.error)
        return out

    def lost(self) -> int:
        return self.c["queue_drops"]
