"""The OTLP pipeline sink (``kvtrace attach --otlp URL``) and the replay of a recorded dataset
(``kvtrace export DIR --otlp URL``): the same correlation and span model, so both send the same
spans.  Spans are encoded on the caller's thread and queued; the exporter's thread sends them.
"""
from __future__ import annotations

import queue
import threading
import time

from kvtrace.correlate.live import LiveCorrelator
from kvtrace.otlp import encode
from kvtrace.otlp.exporter import Exporter
from kvtrace.otlp.metrics import Metrics
from kvtrace.otlp.model import (Span, chunk_spans, encoded_chunk_spans, encoded_other_spans, encoded_request_spans,
                                request_span)
from kvtrace.correlate.requests import request_row
from kvtrace.correlate.derive import correlate_dataset, no_gc
from kvtrace.correlate.requests import trace_info


def spans_of_pass(res, closed, trace_of, run: str, offset: int) -> list[Span]:
    """The spans of one correlation pass as Span tuples (the reference path; tests)."""
    spans = chunk_spans(res, trace_of, offset)
    for acc in closed:
        spans.append(request_span(request_row(run, acc), acc, offset))
    return spans


def encoded_spans_of_pass(res, closed, trace_of, run: str, offset: int, rows: list[dict] | None = None) -> list[bytes]:
    """The same spans, encoded (chunk and request spans column-wise): what is sent.  rows: the
    closed requests' rows when already made (in the order of closed)."""
    out = encoded_chunk_spans(res, trace_of, offset)
    out += encoded_other_spans(res, trace_of, offset)
    if rows is None:
        rows = [request_row(run, a) for a in closed]
    out += encoded_request_spans(rows, closed, offset)
    return out


class OtlpSink:
    """Pipeline sink: ``consume(tables)`` every flush, ``finish()`` at a clean stop, ``stats()``."""

    name = "otlp"

    def __init__(self, url: str, protocol: str, run: str, host: str, clock_offset_ns: int, *,
                 lateness_s: float = 3.0, every_s: float | None = None, exporter_kw: dict | None = None,
                 correlator_kw: dict | None = None, inbox: int = 8):
        self.run, self.offset = run, clock_offset_ns
        # a correlation pass re-reads every row still in the window (lateness + the time between
        # passes): a pass every `lateness` reads each row about twice, one every flush four times
        self.every_ns = int((lateness_s if every_s is None else every_s) * 1e9)
        self.next_pass = 0
        self.resource = encode.resource_attrs(host, run)
        self.exporter = Exporter(url, protocol, self.resource, **(exporter_kw or {}))
        self.live = LiveCorrelator(run, lateness_ns=int(lateness_s * 1e9), **(correlator_kw or {}))
        self.metrics = Metrics(time.monotonic_ns() + clock_offset_ns)
        self.spans = 0
        self.errors = 0
        self.last_error = ""
        self.finished = False
        # correlation runs on its own thread: the flush loop (Parquet, the ring buffer) never waits for it
        self.inbox: queue.Queue = queue.Queue(maxsize=inbox)
        self.input_dropped_batches = self.input_dropped_rows = 0
        self.thread = threading.Thread(target=self._run, name="kvtrace-otlp-correlate", daemon=True)
        self.thread.start()

    def consume(self, tables) -> None:
        """Hand one flush's tables to the sink's thread; never waits (a full inbox drops, counted)."""
        if self.finished:
            return
        try:
            self.inbox.put_nowait((time.monotonic_ns(), tables))   # the flush's time: its pass's now
        except queue.Full:
            self.input_dropped_batches += 1
            self.input_dropped_rows += sum(t.num_rows for t in tables.values())

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            now, tables = item
            try:
                self.live.feed(tables)
                if now >= self.next_pass:
                    self.next_pass = now + self.every_ns
                    self._advance(now)
            except Exception as e:  # a correlation bug must not stop capture
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:300]

    def _advance(self, now: int | None) -> None:
        res, closed = self.live.advance(now)
        spans = encoded_spans_of_pass(res, closed, self.live.trace_of, self.run, self.offset)
        if spans:
            self.exporter.submit(spans)
            self.spans += len(spans)
        self.metrics.add(res)
        wall = (now if now is not None else time.monotonic_ns()) + self.offset
        self.exporter.submit_metrics(self.metrics.request(self.resource, wall))

    def finish(self, timeout: float = 10.0) -> None:
        if self.finished:
            return
        self.finished = True
        self.inbox.put(None)  # after every queued flush
        self.thread.join()
        try:
            self._advance(None)
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
        self.exporter.close(timeout)

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            try:
                self.inbox.put_nowait(None)
            except queue.Full:
                pass
            self.exporter.close(1.0)

    def stats(self) -> dict:
        return {"name": self.name, "url": self.exporter.url, "protocol": self.exporter.protocol,
                "spans_built": self.spans, "correlation_errors": self.errors, "last_correlation_error": self.last_error,
                "buffered_rows": self.live.buffered(), "buffer_dropped_rows": self.live.dropped_rows,
                "requests_forced_closed": self.live.requests.forced, "input_dropped_batches": self.input_dropped_batches,
                "input_dropped_rows": self.input_dropped_rows, **self.exporter.stats.as_dict()}

    def describe(self) -> str:
        line = self.exporter.describe()
        if self.live.dropped_rows:
            line += f"; {self.live.dropped_rows} rows dropped from the correlation window (memory bound)"
        if self.input_dropped_rows:
            line += (f"; {self.input_dropped_rows} rows of {self.input_dropped_batches} flushes not correlated "
                     "(correlation fell behind)")
        if self.errors:
            line += f"; {self.errors} correlation errors ({self.last_error})"
        return line


def replay(root, url: str, protocol: str, run: str | None = None, exporter_kw: dict | None = None,
           progress=None) -> tuple[list, list[dict]]:
    """Send a recorded dataset's spans and metrics; returns (exporters' stats, per-run counts)."""

    out = []
    stats = []
    for rc, _ in correlate_dataset(root, run=run, write=False):
        info = rc.info
        resource = encode.resource_attrs(info.host, info.run)
        trace_of = lambda r, t=rc.traces, i=info: t.get(r) or _fallback(i.run, r)  # noqa: E731
        with no_gc():
            enc = encoded_spans_of_pass(rc.result, rc.accs, trace_of, info.run, info.clock_offset_ns, rc.rows)
        spans = enc
        exp = Exporter(url, protocol, resource, **(exporter_kw or {"max_queue": 1 << 30, "max_queue_bytes": 1 << 40}))
        exp.submit(enc)
        metrics = Metrics(info.start_ns + info.clock_offset_ns)
        metrics.add(rc.result)
        end = max([int(x) for x in rc.result.steps["t_end_ns"].to_pylist()] or [info.start_ns])
        exp.submit_metrics(metrics.request(resource, end + info.clock_offset_ns))
        exp.close(timeout=max(30.0, len(enc) / 2000))
        stats.append(exp)
        out.append({"run": info.run, "host": info.host, "spans": len(spans), "requests": rc.requests.num_rows,
                    "chunks": rc.result.chunks.num_rows, **exp.stats.as_dict()})
        if progress:
            progress(out[-1], exp)
    return stats, out


def _fallback(run: str, request: str):

    return trace_info(run, request, None)
