"""Correlation while attached: the same pure functions as offline, on a sliding window.

Rows are buffered as they are decoded.  Each pass finalises the steps that ended more than
``lateness`` ago (every record of such a step has arrived by then: the hook flushes at step end,
KV transfers within 200 ms, the ring buffer every flush interval) and drops the rows it decided.
Kernel rows that fall in no step are decided once they are older than the schedule start of the
latest step seen (no later step can hold them).  Requests close when vLLM reports them finished,
after ``idle`` without activity, or at stop.  Memory is bounded: past ``max_rows`` buffered rows
the oldest undecided kernel rows are dropped and counted.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.correlate.pd_live import LivePairs, handed_arrive
from kvtrace.correlate.causes import CacheReplay
from kvtrace.correlate.core import Result, correlate
from kvtrace.correlate.inputs import OVERLAP_PREFIXES, TABLES_USED
from kvtrace.correlate.requests import Acc, Requests, trace_info

KEEP = ("processes", "hook_start")  # small tables kept for the whole run
KERNEL_TIME = {"block_io": "start_ns", "file_io": "start_ns", "io_uring": "submit_ns"}


class LiveCorrelator:
    def __init__(self, run: str, lateness_ns: int = 3_000_000_000, idle_ns: int = 300_000_000_000,
                 max_rows: int = 1_000_000, io_span_bytes: int = 1 << 20):
        self.run = run
        self.lateness = lateness_ns
        self.idle = idle_ns
        self.max_rows = max_rows
        self.io_span_bytes = io_span_bytes
        self.buf: dict[str, pa.Table] = {}
        self.requests = Requests(run)
        self.dropped_rows = 0
        self.passes = 0
        self.closed: dict[str, Acc] = {}
        self.replay = CacheReplay()   # the prefix cache, kept over passes for the miss causes
        self.pairs = LivePairs(run)   # prefill/decode pairs of the servers traced together

    def wanted(self, name: str) -> bool:
        return name in TABLES_USED or name.startswith(OVERLAP_PREFIXES)

    def feed(self, tables: dict[str, pa.Table]) -> None:
        handed = self.pairs.feed(tables)
        if handed:      # prefill/decode pairs: the decode requests join the prefill's trace
            self._hand(handed, tables)
        for name, t in tables.items():
            if t.num_rows == 0 or not self.wanted(name):
                continue
            t = t.replace_schema_metadata(None)
            old = self.buf.get(name)
            self.buf[name] = t if old is None else pa.concat_tables([old, t], promote_options="default")
        self._bound()

    def _hand(self, handed: dict[str, str], tables: dict[str, pa.Table]) -> None:
        for where in (tables, self.buf):
            if where.get("arrive") is not None and where["arrive"].num_rows:
                where["arrive"] = handed_arrive(where["arrive"], handed)
        for r, tp in handed.items():
            a = self.requests.open.get(r)
            if a is not None and a.arrive is not None and not a.arrive["traceparent"]:
                a.arrive = {**a.arrive, "traceparent": tp}

    def _bound(self) -> None:
        total = sum(t.num_rows for t in self.buf.values())
        if total <= self.max_rows:
            return
        for name in ("file_io", "block_io", "io_uring"):
            t = self.buf.get(name)
            if t is None or t.num_rows == 0:
                continue
            excess = sum(x.num_rows for x in self.buf.values()) - self.max_rows // 2
            if excess <= 0:
                break
            cut = min(excess, t.num_rows)
            order = np.argsort(t[KERNEL_TIME[name]].to_numpy(), kind="stable")
            self.buf[name] = t.take(np.sort(order[cut:]))
            self.dropped_rows += cut

    def horizon(self, watermark: int | None) -> int | None:
        if watermark is None:
            return None
        st = self.buf.get("step")
        if st is None or st.num_rows == 0:
            return watermark
        pid = st["pid"].to_numpy()
        ts = st["t_sched_end_ns"].to_numpy()
        latest = min(int(ts[pid == p].max()) for p in np.unique(pid))
        return min(watermark, latest)

    def advance(self, now_ns: int | None) -> tuple[Result, list[Acc]]:
        """One pass: finalise what is old enough (everything when now_ns is None)."""
        self.passes += 1
        w = None if now_ns is None else now_ns - self.lateness
        h = self.horizon(w)
        res = correlate(self.buf, self.run, final_before=w, horizon=h, io_span_bytes=self.io_span_bytes,
                        replay=self.replay)
        self.requests.add(res)
        for name, done in res.done.items():
            t = self.buf.get(name)
            if t is None or len(done) != t.num_rows or not done.any():
                continue
            self.buf[name] = t.filter(pa.array(~done))
        closed = self.requests.close(w, self.idle)
        self.closed = {a.request: a for a in closed}
        ar = self.buf.get("arrive")
        if ar is not None and ar.num_rows:
            keep = np.array([r in self.requests.open for r in ar["request"].to_pylist()], bool)
            self.buf["arrive"] = ar.filter(pa.array(keep))
        for name in list(self.buf):
            if name in ("chunk", "admit", "evict", "preempt", "finish") and w is None:
                self.buf.pop(name)
        return res, closed

    def trace_of(self, request: str):
        a = self.requests.open.get(request) or self.closed.get(request)
        return trace_info(self.run, request, a)

    def buffered(self) -> int:
        return sum(t.num_rows for t in self.buf.values())
