"""The capture pipeline, wired in one place:

    source (ring buffer, kvtrace.capture.loader)
      → decode (one decoder per probe, kvtrace.capture.<probe>)
      → correlate (later stages join kernel and vLLM events)
      → sinks (Parquet dataset, live status line)

``Pipeline.step()`` moves one batch through; the attach command calls it once per flush.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import time
import uuid
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from kvtrace import __version__
from kvtrace.capture import BY_KIND, events, fdopen, memory, rawfile
from kvtrace.capture.events import DecodeContext
from kvtrace.capture.program import Plan
from kvtrace.dataset import schema
from kvtrace.dataset.writer import DatasetWriter
from kvtrace.correlate.derive import correlate_dataset

# Decode opens before reads so fd→path resolution sees them.
DECODE_ORDER = [events.KIND_PROC, events.KIND_FDOPEN]


def clock_offset_ns() -> int:
    """wall - monotonic, from the tightest of a few paired reads (bpf_ktime_get_ns is CLOCK_MONOTONIC)."""
    best = None
    for _ in range(5):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, w - (m0 + m1) // 2)
    return best[1]


TRIM_EVERY = 10  # flushes between malloc_trim calls
STARTUP_FLUSHES = 2  # after these, the pages of code only the start-up ran are given back


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


@dataclass
class Totals:
    events: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_written: int = 0

    def total(self) -> int:
        return sum(self.events.values())


class Pipeline:
    def __init__(self, source, plan: Plan, writer: DatasetWriter, pids: list[int], command: str = "", raw_out=None,
                 fresh_pids: tuple[int, ...] = (), release_startup: bool = False):
        self.source = source
        self.raw_out = raw_out
        self.plan = plan
        self.writer = writer
        self.ctx = DecodeContext()
        self.totals = Totals()
        self.pids = list(pids)
        self.command = command
        self.start_ns = time.monotonic_ns()
        self.offset = clock_offset_ns()
        self.start_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.sidecars: list = []
        self.sinks: list = []  # live consumers of every flush's tables (kvtrace.otlp.sink)
        self.notes: list[str] = []  # what a clean stop could not do (said by the caller)
        self.steps = 0
        self._trim = memory.malloc_trim()
        self.release_startup = release_startup
        self.released_bytes = 0
        for pid in pids:
            if pid not in fresh_pids:  # a command kvtrace starts has no files open before the attach
                fdopen.snapshot(self.ctx, pid)

    def decode(self, batch: dict[int, list[bytes]]) -> dict[str, pa.Table]:
        out = {}
        kinds = DECODE_ORDER + [k for k in batch if k not in DECODE_ORDER]
        for kind in kinds:
            raw = batch.get(kind)
            probe = BY_KIND.get(kind)
            if not raw:
                continue
            if probe is None:
                self.ctx.malformed += len(raw)
                continue
            if not getattr(probe, "VARIABLE_SIZE", False):
                size = probe.DTYPE.itemsize
                self.ctx.malformed += sum(1 for r in raw if not r or len(r) % size)
            decoded = probe.decode(raw, self.ctx)
            if isinstance(decoded, dict):
                out.update(decoded)
            else:
                out[probe.TABLE] = decoded
        fdopen.trim(self.ctx)
        return out

    def step(self, status: str = "running") -> dict[str, pa.Table]:
        batch = self.source.drain()
        if self.raw_out is not None:
            rawfile.append(self.raw_out, batch)
        tables = self.decode(batch)
        for sidecar in self.sidecars:
            for name, table in sidecar.drain().items():
                tables[name] = pa.concat_tables([tables[name], table]) if name in tables else table
        for name, table in tables.items():
            self.totals.events[name] = self.totals.events.get(name, 0) + table.num_rows
            if name == "file_io":
                reads = pc.is_in(table["syscall"], pa.array(["read", "pread64", "readv", "preadv", "preadv2"]))
                nbytes = pc.multiply(table["bytes"], table["weight"].cast(pa.uint64())) if "weight" in table.column_names else table["bytes"]
                self.totals.bytes_read += int(pc.sum(pc.if_else(reads, nbytes, 0)).as_py() or 0)
                self.totals.bytes_written += int(pc.sum(pc.if_else(reads, 0, nbytes)).as_py() or 0)
            self.writer.add(name, table)
        for sink in self.sinks:
            sink.consume(tables)
        self.writer.flush(self.run_row(status))
        self.steps += 1
        if self.steps == STARTUP_FLUSHES and self.release_startup:
            # imports, compiling, the first flushes: code that ran once (docs/performance.md)
            self.released_bytes = memory.release_file_pages()
        if self._trim is not None and self.steps % TRIM_EVERY == 0:
            # give back the C heap that decoding and writing freed (glibc keeps it otherwise):
            # a few ms every TRIM_EVERY flushes, tens of MB of resident memory
            self._trim(0)
        return tables

    def lost_by_table(self) -> dict[str, int]:
        lost = {BY_KIND[k].TABLE if k in BY_KIND else f"kind{k}": v for k, v in self.source.lost().items()}
        if self.ctx.malformed:
            lost["malformed"] = self.ctx.malformed
        if self.ctx.bad_frames:   # each one a write of the hook's records
            lost["hook_frames"] = self.ctx.bad_frames
        for sidecar in self.sidecars:
            if hasattr(sidecar, "lost"):
                name = getattr(sidecar, "name", type(sidecar).__name__)
                lost[name] = lost.get(name, 0) + sidecar.lost()
        return lost

    def kernel_skips(self) -> dict[str, int]:
        """{event: times the kernel did not run kvtrace's program for it} (kvtrace.capture.progstats)."""
        fn = getattr(self.source, "kernel_skips", None)
        return fn() if fn is not None else {}

    def add_sidecar(self, sidecar) -> None:
        """A source beside the ring buffer (vLLM KV events, /metrics) running on its own thread:
        ``drain() -> {table: pa.Table}`` each step, ``stats() -> dict`` into the run row, and
        optionally ``name``, ``lost() -> int`` and ``close()`` (called by ``finish``)."""
        self.sidecars.append(sidecar)

    def add_sink(self, sink) -> None:
        """A consumer of each flush's decoded tables (the OTLP exporter): ``consume(tables)`` each
        step, ``finish()`` at a clean stop, ``close()`` otherwise, ``stats() -> dict`` into the run
        row.  It must not block: it queues and drops, counted."""
        self.sinks.append(sink)

    def run_row(self, status: str) -> dict:
        return {
            "run": self.writer.run,
            "status": status,
            "schema_version": schema.SCHEMA_VERSION,
            "kvtrace_version": __version__,
            "kernel": platform.release(),
            "start_ns": self.start_ns,
            "stop_ns": time.monotonic_ns(),
            "clock_offset_ns": self.offset,
            "start_wall": self.start_wall,
            "pids": self.pids,
            "command": self.command,
            "probes_attached": self.plan.attached,
            "probes_skipped": json.dumps(self.plan.skipped),
            "events": json.dumps(self.totals.events),
            "lost_events": json.dumps(self.lost_by_table()),
            "dropped_events": self.source.dropped,
            "kernel_skips": json.dumps(self.kernel_skips()),
            "sidecars": json.dumps([{"name": getattr(s, "name", type(s).__name__), **s.stats()} for s in self.sidecars]),
            "sinks": json.dumps([s.stats() for s in self.sinks]),
            "sampling": json.dumps(self.sampling()),
        }

    def sampling(self) -> dict:
        """Raw-event sampling per table (kvtrace.capture.agg), for the run row."""
        out = {}
        for sidecar in self.sidecars:
            if hasattr(sidecar, "sampling"):
                out.update(sidecar.sampling())
        return out

    def finish(self) -> None:
        for sidecar in self.sidecars:
            if hasattr(sidecar, "close"):
                sidecar.close()
        self.step(status="complete")
        for sink in self.sinks:
            sink.finish()
        if self.sinks:
            self.writer.write_run(self.run_row("complete"))
        self.writer.compact()
        self.derive()

    def derive(self) -> None:
        """Add this run's derived tables (requests, chunks, steps, attributions; kvtrace.correlate)."""
        try:

            correlate_dataset(self.writer.root, run=self.writer.run)
        except Exception as e:  # the raw tables are written; `kvtrace correlate DIR` can retry
            self.notes.append(f"derived tables not written ({type(e).__name__}: {e}); run kvtrace correlate {self.writer.root}")


def default_host() -> str:
    return os.environ.get("KVTRACE_HOST") or socket.gethostname()
