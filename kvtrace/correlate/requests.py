"""Per-request accumulation of correlation results, and the ``requests`` rows made from them.

Live, results arrive pass by pass and a request is closed when vLLM reports it finished (or it
has been idle for ``idle_ns``, or capture stops); offline, one pass holds everything.  Either way
a request's row depends only on what was accumulated for it, so both give the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from kvtrace.correlate import ids
from kvtrace.correlate.causes import MISSES, causes_of
from kvtrace.correlate.core import Result


@dataclass
class Acc:
    request: str
    engine_pid: int = 0
    arrive: dict | None = None
    finish: dict | None = None
    admits: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    preempts: list = field(default_factory=list)     # this request was preempted
    evicts: int = 0                                  # blocks evicted by this request's allocations
    transfers: list = field(default_factory=list)    # named KV transfers (spans and totals)
    segments: list = field(default_factory=list)     # its tokens by miss cause (kvtrace.correlate.causes)
    connector: list = field(default_factory=list)    # its kv_alloc / kv_done rows (any KV connector)
    last_ns: int = 0                                 # last activity (monotonic)


# what request rows and request spans read of each chunk
CHUNK_COLS = ("request", "engine_pid", "step", "attempt", "chunk_index", "last", "prompt_len", "tokens",
              "storage_wait_ns", "compute_ns", "t_start_ns", "t_end_ns")


class Requests:
    def __init__(self, run: str, max_open: int = 200_000):
        self.run = run
        self.open: dict[str, Acc] = {}
        self.max_open = max_open
        self.forced = 0  # closed early because too many were open

    def _acc(self, r: str, engine: int = 0) -> Acc:
        a = self.open.get(r)
        if a is None:
            a = self.open[r] = Acc(r, engine)
        elif engine and not a.engine_pid:
            a.engine_pid = engine
        return a

    def add(self, res: Result) -> None:
        for ar in res.arrives:
            a = self._acc(ar["request"], ar["engine_pid"])
            if a.arrive is None or (ar["traceparent"] and not a.arrive["traceparent"]):
                a.arrive = ar
        for ad in res.admits:
            a = self._acc(ad["request"], ad["pid"])
            if not any(x["attempt"] == ad["attempt"] for x in a.admits):
                a.admits.append(ad)
        ch = res.chunks
        if ch.num_rows:
            cols = {k: ch[k].to_pylist() for k in CHUNK_COLS}
            for row in zip(*cols.values()):
                row = dict(zip(CHUNK_COLS, row))
                a = self._acc(row["request"], row["engine_pid"])
                a.chunks.append(row)
                if row["t_end_ns"] > a.last_ns:
                    a.last_ns = row["t_end_ns"]
        for p in res.preempts:
            a = self._acc(p["request"], p["engine_pid"])
            a.preempts.append(p)
            a.last_ns = max(a.last_ns, p["t_ns"])
        for e in res.evicts:
            if e["request"]:
                self._acc(e["request"], e["engine_pid"]).evicts += 1
        for t in res.transfers:
            if t["request"]:
                a = self._acc(t["request"], t["engine_pid"])
                a.transfers.append(t)
                a.last_ns = max(a.last_ns, t["t_end_ns"])
        for c in res.connector:
            a = self._acc(c["request"], c["engine_pid"])
            a.connector.append(c)
            a.last_ns = max(a.last_ns, c["t_ns"])
        for seg in res.segments:
            self._acc(seg.request, seg.engine_pid).segments.append(seg)
        for f in res.finishes:
            a = self._acc(f["request"], f["engine_pid"])
            if a.finish is None:
                a.finish = f
                a.last_ns = max(a.last_ns, f["t_ns"])

    def close(self, watermark: int | None = None, idle_ns: int = 300_000_000_000) -> list[Acc]:
        """Requests to close now: finished before the watermark, idle for idle_ns, or all (None)."""
        out = []
        for r, a in list(self.open.items()):
            if watermark is None or (a.finish is not None and a.finish["t_ns"] <= watermark) or \
                    (a.last_ns and a.last_ns + idle_ns <= watermark):
                out.append(self.open.pop(r))
        if len(self.open) > self.max_open:
            for r in sorted(self.open, key=lambda r: self.open[r].last_ns)[: len(self.open) - self.max_open]:
                out.append(self.open.pop(r))
                self.forced += 1
        return out


def trace_info(run: str, request: str, acc: Acc | None) -> tuple[bytes, bytes, bool, str]:
    """(trace id, parent span id of the request span, joined a caller's trace?, tracestate)."""
    tp = acc.arrive["traceparent"] if acc is not None and acc.arrive else ""
    trace, parent, joined = ids.trace_of(run, request, tp)
    return trace, parent, joined, (acc.arrive["tracestate"] if joined else "")


REQUEST_SCHEMA = pa.schema([
    ("engine_pid", pa.uint32()), ("request", pa.string()), ("external_id", pa.string()),
    ("arrival_ns", pa.uint64()), ("first_scheduled_ns", pa.uint64()), ("prefill_end_ns", pa.uint64()),
    ("finish_ns", pa.uint64()), ("start_ns", pa.uint64()), ("end_ns", pa.uint64()), ("queue_ns", pa.int64()),
    ("prompt_len", pa.uint32()), ("admissions", pa.uint32()), ("preemptions", pa.uint32()), ("chunks", pa.uint32()),
    ("prefill_tokens", pa.uint64()), ("cached_tokens", pa.uint32()), ("cached_local", pa.uint32()),
    ("cached_external", pa.uint32()), ("hit_blocks", pa.uint32()), ("readmit_cached_tokens", pa.uint32()),
    ("evicted_blocks", pa.uint32()), ("load_count", pa.uint32()), ("load_bytes", pa.uint64()),
    ("load_ns", pa.int64()), ("store_count", pa.uint32()), ("store_bytes", pa.uint64()),
    ("storage_wait_ns", pa.int64()), ("compute_ns", pa.int64()), ("finished", pa.bool_()),
    ("joined_trace", pa.bool_()), ("trace_id", pa.string()), ("span_id", pa.string()),
    ("parent_span_id", pa.string()),
    *[(c, pa.uint32()) for c in MISSES], ("readmit_recomputed_tokens", pa.uint32()),
    ("kv_connector", pa.string()), ("connector_load_tokens", pa.uint32()), ("connector_load_bytes", pa.uint64()),
    ("connector_load_wait_ns", pa.int64()), ("connector_load_failed", pa.uint32()),
    ("cached_elsewhere", pa.uint32()),
])


def request_row(run: str, a: Acc) -> dict:
    tp = a.arrive["traceparent"] if a.arrive else ""
    trace, parent, joined = ids.trace_of(run, a.request, tp)
    chunks = a.chunks
    first = None
    readmit = 0
    for x in a.admits:
        if x["attempt"] == 0:
            first = x
        else:
            readmit += x["cached_local"] + x["cached_external"]
    arrival = a.arrive["t_ns"] if a.arrive else 0
    first_sched = min((c["t_start_ns"] for c in chunks), default=0)
    prefill_end = max((c["t_end_ns"] for c in chunks if c["last"]), default=0)
    finish = a.finish["t_ns"] if a.finish else 0
    loads = [t for t in a.transfers if t["dir"] == "load"]
    stores = [t for t in a.transfers if t["dir"] == "store"]
    end = max(max((c["t_end_ns"] for c in chunks), default=0), max((p["t_ns"] for p in a.preempts), default=0),
              max((t["t_end_ns"] for t in a.transfers), default=0), finish, arrival)
    start_candidates = [x for x in (arrival, first_sched) if x] + [t["t_start_ns"] for t in a.transfers]
    start = min(start_candidates) if start_candidates else 0
    if first is not None:
        prompt = first["prompt_len"]
    elif a.admits:
        prompt = min(a.admits, key=lambda x: x["attempt"])["prompt_len"]
    else:
        prompt = min(chunks, key=lambda c: (c["t_start_ns"], c["step"]))["prompt_len"] if chunks else 0
    return {
        "engine_pid": a.engine_pid, "request": a.request, "external_id": ids.external_id(a.request),
        "arrival_ns": arrival, "first_scheduled_ns": first_sched, "prefill_end_ns": prefill_end,
        "finish_ns": finish, "start_ns": start, "end_ns": max(end, start),
        "queue_ns": (first_sched - arrival) if arrival and first_sched else 0,
        "prompt_len": prompt, "admissions": len(a.admits), "preemptions": len(a.preempts), "chunks": len(chunks),
        "prefill_tokens": sum(c["tokens"] for c in chunks),
        "cached_tokens": (first["cached_local"] + first["cached_external"]) if first else 0,
        "cached_local": first["cached_local"] if first else 0,
        "cached_external": first["cached_external"] if first else 0,
        "hit_blocks": first["hit_blocks"] if first else 0,
        "readmit_cached_tokens": readmit,
        "evicted_blocks": a.evicts, "load_count": len(loads), "load_bytes": sum(t["nbytes"] for t in loads),
        "load_ns": sum(t["t_end_ns"] - t["t_start_ns"] for t in loads), "store_count": len(stores),
        "store_bytes": sum(t["nbytes"] for t in stores),
        "storage_wait_ns": sum(c["storage_wait_ns"] for c in chunks), "compute_ns": sum(c["compute_ns"] for c in chunks),
        "finished": a.finish is not None, "joined_trace": joined, "trace_id": trace.hex(),
        "span_id": ids.request_span(trace, a.request).hex(), "parent_span_id": parent.hex(),
        **_causes(a), **_connector(a),
    }


def _connector(a: Acc) -> dict:
    """The connector's loads for this request as its scheduler saw them: the connector, tokens and
    bytes loaded, and how long the request waited for its async loads (alloc to done)."""
    allocs = sorted((c for c in a.connector if c["what"] == "alloc"), key=lambda c: c["t_ns"])
    dones = sorted((c["t_ns"] for c in a.connector if c["what"] == "done" and c["direction"] == "load"))
    wait = 0
    for al in allocs:
        if al["async"]:
            done = next((t for t in dones if t >= al["t_ns"]), None)
            wait += (done - al["t_ns"]) if done is not None else 0
    return {"kv_connector": allocs[0]["connector"] if allocs else "",
            "connector_load_tokens": sum(c["external"] for c in allocs),
            "connector_load_bytes": sum(c["nbytes"] for c in allocs), "connector_load_wait_ns": wait,
            "connector_load_failed": sum(1 for c in a.connector if c["what"] == "done" and not c.get("ok", 1)
                                         and c["direction"] == "load")}


def _causes(a: Acc) -> dict:
    """The first admission's misses by cause; the tokens recomputed at re-admissions."""
    by = causes_of(a.segments)
    first = by.get(0, {})
    again = sum(v for att, d in by.items() if att > 0 for k, v in d.items() if k in MISSES)
    elsewhere = max((s.elsewhere for s in a.segments if s.attempt == 0), default=0)
    return {**{c: first.get(c, 0) for c in MISSES}, "readmit_recomputed_tokens": again, "cached_elsewhere": elsewhere}


def requests_table(run: str, accs: list[Acc], rows: list[dict] | None = None) -> pa.Table:
    """The requests rows (sorted by start) of closed requests; rows: request_row of each, if made."""
    rows = [request_row(run, a) for a in accs] if rows is None else rows
    rows = sorted(rows, key=lambda r: (r["start_ns"], r["request"]))
    return pa.Table.from_pydict({f.name: [r[f.name] for r in rows] for f in REQUEST_SCHEMA}, schema=REQUEST_SCHEMA)
