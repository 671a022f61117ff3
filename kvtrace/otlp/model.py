"""The span model (docs/otlp.md): one trace per request.

    kvtrace.request                       arrival (or first schedule) -> finish; events: admit, preempted
      kvtrace.prefill_chunk               one per prefill chunk: its step's window; events: evict, preempt
        kvtrace.nvme                      the NVMe commands overlapping the chunk's step, per controller,
                                          queue and op class (every chunk of the step waited for them)
        kvtrace.kv_load / kvtrace.kv_store  a connector transfer that names the request
          kvtrace.block_io / file_io / io_uring   the kernel I/O issued by that transfer's thread while
                                          it ran: one span per block I/O >= the size threshold, the rest
                                          aggregated per device and direction
          kvtrace.nvme_cmd                the NVMe commands that thread's I/O became, per controller,
                                          queue and op class

A request that carried a W3C traceparent keeps its trace id; the request span's parent is the
caller's span (vLLM's llm_request span is its sibling).  Times are wall clock (monotonic + the
run's clock offset).  Attributes follow OpenTelemetry's gen_ai and system conventions where one
fits (gen_ai.request.id, gen_ai.usage.input_tokens, process.pid, thread.id, system.device,
disk.io.direction) and use the ``kvtrace.`` namespace otherwise.
"""
from __future__ import annotations

from typing import NamedTuple

from kvtrace.correlate import ids
from kvtrace.correlate.causes import MISSES
from kvtrace.correlate.requests import Acc
from kvtrace.otlp import encode

MAX_EVENTS = 64  # per span; the rest are counted in dropped_events_count
KIND_INTERNAL = 1


class Span(NamedTuple):
    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    name: str
    start: int          # unix ns
    end: int
    attrs: tuple        # ((key, value), ...): int, float, bool or str values
    events: tuple = ()  # ((unix ns, name, attrs), ...)
    trace_state: str = ""
    dropped_events: int = 0
    error: bool = False


def _events(evs: list) -> tuple[tuple, int]:
    if len(evs) > 1:
        evs = sorted(evs, key=lambda e: (e[0], e[1]))
    return tuple(evs[:MAX_EVENTS]), max(len(evs) - MAX_EVENTS, 0)


def chunk_spans(res, trace_of, offset: int) -> list[Span]:
    """Spans of the chunks finalised in one correlation pass, with their transfers and kernel I/O.

    trace_of(request) -> (trace id, parent span id, joined, tracestate)."""
    out = _prefill_spans(res, trace_of, offset)
    spans_of_transfer = _transfer_spans(res, trace_of, offset, out)
    out.extend(_io_spans(res, spans_of_transfer, offset))
    out.extend(_nvme_spans(res, trace_of, offset))
    return out


def _chunk_events(res, offset: int) -> dict[tuple, list]:
    """(request, attempt, step) -> the evict and preempt events of that chunk."""
    ev_by_chunk: dict[tuple, list] = {}
    for e in res.evicts:
        if e["chunk"] is not None:
            ev_by_chunk.setdefault((e["request"],) + e["chunk"], []).append(
                (e["t_ns"] + offset, "kvtrace.evict", (("kvtrace.block.hash", f"{e['block_hash']:016x}"),
                                                      ("kvtrace.block.id", e["block_id"]),
                                                      ("kvtrace.block.group", e["group"]),
                                                      ("kvtrace.block.medium", e["medium"]))))
    for p in res.preempts:
        if p["for_chunk"] is not None:
            ev_by_chunk.setdefault((p["for_request"],) + p["for_chunk"], []).append(
                (p["t_ns"] + offset, "kvtrace.preempt", (("kvtrace.preempt.victim", p["request"]),
                                                        ("kvtrace.preempt.computed_tokens", p["computed_before"]),
                                                        ("kvtrace.preempt.num_tokens", p["num_tokens"]))))
    return ev_by_chunk


def _prefill_spans(res, trace_of, offset: int) -> list[Span]:
    out: list[Span] = []
    ev_by_chunk = _chunk_events(res, offset)
    ch = res.chunks
    if ch.num_rows:
        cols = {k: ch[k].to_pylist() for k in ch.column_names}
        for i in range(ch.num_rows):
            r = cols["request"][i]
            trace = bytes.fromhex(cols["trace_id"][i])
            state = trace_of(r)[3]
            evs, dropped = _events(ev_by_chunk.get((r, cols["attempt"][i], cols["step"][i]), []))
            out.append(Span(
                trace, bytes.fromhex(cols["span_id"][i]), bytes.fromhex(cols["parent_span_id"][i]),
                "kvtrace.prefill_chunk", cols["t_start_ns"][i] + offset, cols["t_end_ns"][i] + offset, (
                    ("kvtrace.request.id", r), ("gen_ai.request.id", ids.external_id(r)),
                    *((key, cols[c][i]) for key, c, _ in CHUNK_ATTRS)), evs, state, dropped))
    return out


def _transfer_spans(res, trace_of, offset: int, out: list[Span]) -> dict[int, tuple[bytes, bytes, str]]:
    """Appends the kv_load/kv_store spans to ``out``; transfer index -> (trace, span id, tracestate)."""
    spans_of_transfer: dict[int, tuple[bytes, bytes, str]] = {}
    for k, t in enumerate(res.transfers):
        r = t["request"]
        if not r:
            continue  # an unnamed (per-step) transfer belongs to no single trace: see the chunk's storage wait
        trace, _, _, state = trace_of(r)
        if t["attempt"] is not None:
            parent = ids.chunk_span(trace, r, t["attempt"], t["chunk_step"])
        else:
            parent = ids.request_span(trace, r)
        sid = ids.transfer_span(trace, t["dir"], t["pid"], t["tid"], t["t_start_ns"], t["seq"])
        spans_of_transfer[k] = (trace, sid, state)
        out.append(Span(trace, sid, parent, f"kvtrace.kv_{t['dir']}", t["t_start_ns"] + offset, t["t_end_ns"] + offset, (
            ("kvtrace.request.id", r), ("kvtrace.transfer.source", t["source"]),
            ("kvtrace.transfer.blocks", t["blocks"]), ("kvtrace.transfer.bytes", t["nbytes"]),
            ("kvtrace.transfer.wait_ns", t["wait_ns"]), ("kvtrace.attribution.how", t["how"]),
            ("process.pid", t["pid"]), ("thread.id", t["tid"]),
        ), (), state))
    return spans_of_transfer


def _io_spans(res, spans_of_transfer: dict, offset: int) -> list[Span]:
    """The kernel I/O of each named transfer's thread, under the transfer's span."""
    out: list[Span] = []
    for g in res.io_groups:
        tr = spans_of_transfer.get(g["transfer"])
        if tr is None:
            continue
        trace, parent, state = tr
        key = (g["kind"], g["device"], g["read"], g["first_start_ns"] if g["single"] else "agg")
        attrs = [("kvtrace.io.count", g["count"]), ("kvtrace.io.bytes", g["bytes"]),
                 ("kvtrace.io.latency_ns_sum", g["latency_ns_sum"]), ("kvtrace.io.latency_ns_max", g["latency_ns_max"]),
                 ("kvtrace.io.errors", g["errors"]), ("kvtrace.io.aggregated", not g["single"]),
                 ("disk.io.direction", "read" if g["read"] else "write"), ("kvtrace.attribution.how", "thread_time")]
        if g["kind"] == "block_io":
            attrs += [("system.device", g["device"]), ("kvtrace.io.queue_ns_sum", g["queue_ns_sum"]),
                      ("kvtrace.io.device_ns_sum", g["device_ns_sum"])]
            if g["single"]:
                attrs.append(("kvtrace.io.sector", g["sector"]))
        elif g["kind"] == "file_io":
            attrs.append(("kvtrace.io.files", g["files"]))
        elif g["kind"] == "nvme_cmd":
            attrs = [a for a in attrs if a[0] != "disk.io.direction"] + nvme_attrs(g)
        out.append(Span(trace, ids.io_span(parent, *key), parent, f"kvtrace.{g['kind']}", g["start_ns"] + offset,
                        g["end_ns"] + offset, tuple(attrs), (), state, 0, g["errors"] > 0))
    return out


def _nvme_spans(res, trace_of, offset: int) -> list[Span]:
    """The NVMe commands overlapping each chunk's step, one span per group under every chunk of it."""
    out: list[Span] = []
    for g in getattr(res, "nvme_groups", ()):
        key = ("nvme", g["ctrl"], g["qid"], g["opclass"], g["step"])
        attrs = (("kvtrace.io.count", g["count"]), ("kvtrace.io.bytes", g["bytes"]),
                 ("kvtrace.io.latency_ns_sum", g["latency_ns_sum"]), ("kvtrace.io.latency_ns_max", g["latency_ns_max"]),
                 ("kvtrace.io.errors", g["errors"]), *nvme_attrs(g), ("kvtrace.attribution.how", "time_overlap"))
        for r, attempt, step in g["chunks"]:
            trace, _, _, state = trace_of(r)
            parent = ids.chunk_span(trace, r, attempt, step)
            out.append(Span(trace, ids.io_span(parent, *key), parent, "kvtrace.nvme", g["start_ns"] + offset,
                            g["end_ns"] + offset, attrs, (), state, 0, g["errors"] > 0))
    return out


def nvme_attrs(g: dict) -> list:
    """Attributes of a group of NVMe commands (one controller, queue and op class)."""
    timed = g["count"] - g.get("untraced", 0)
    out = [("kvtrace.nvme.ctrl", g["ctrl"]), ("kvtrace.nvme.qid", g["qid"]), ("kvtrace.nvme.opclass", g["opclass"]),
           ("kvtrace.nvme.transport", g["transport"]), ("kvtrace.nvme.target", g["traddr"]),
           ("kvtrace.nvme.samples", g["samples"]),
           ("kvtrace.nvme.latency_ns_avg", g["latency_ns_sum"] / timed if timed else 0.0)]
    if g.get("untraced"):   # ended without their completion traced: no latency
        out.append(("kvtrace.nvme.untraced", g["untraced"]))
    if g["sq_occ_n"]:
        out.append(("kvtrace.nvme.sq_occupancy_avg", g["sq_occ_sum"] / g["sq_occ_n"]))
    return out


def request_span(row: dict, acc: Acc, offset: int) -> Span:
    r = row["request"]
    evs, dropped = request_events(acc, offset)
    state = acc.arrive["tracestate"] if acc.arrive and row["joined_trace"] else ""
    return Span(bytes.fromhex(row["trace_id"]), bytes.fromhex(row["span_id"]),
                bytes.fromhex(row["parent_span_id"]) if row["parent_span_id"] else b"", "kvtrace.request",
                row["start_ns"] + offset, row["end_ns"] + offset, (
                    ("kvtrace.request.id", r), ("gen_ai.request.id", row["external_id"]),
                    *((key, row[c]) for key, c, _ in REQUEST_ATTRS)), evs, state, dropped)


def request_events(acc: Acc, offset: int) -> tuple[tuple, int]:
    evs = []
    chunk0 = {c["attempt"]: c["t_start_ns"] for c in acc.chunks if c["chunk_index"] == 0}
    for a in sorted(acc.admits, key=lambda x: x["attempt"]):
        t = chunk0.get(a["attempt"])
        if t is None:
            continue
        evs.append((t + offset, "kvtrace.admit", (("kvtrace.admit.attempt", a["attempt"]),
                                                 ("kvtrace.admit.cached_local_tokens", a["cached_local"]),
                                                 ("kvtrace.admit.cached_external_tokens", a["cached_external"]),
                                                 ("kvtrace.admit.hit_blocks", a["hit_blocks"]),
                                                 ("kvtrace.admit.prefill_len", a["prefill_len"]))))
    for p in acc.preempts:
        evs.append((p["t_ns"] + offset, "kvtrace.preempted", (("kvtrace.preempt.computed_tokens", p["computed_before"]),
                                                             ("kvtrace.preempt.num_tokens", p["num_tokens"]),
                                                             ("kvtrace.preempt.for_request", p["for_request"]))))
    return _events(evs)


# ---------------------------------------------------------------------------------------------
# The same spans, encoded column-wise (kvtrace.otlp.encode.spans_columnar): what the live sink
# and export send.  tests/unit/test_otlp.py checks they decode equal to the Span path above.

# (attribute, chunks column, kind): i = integer, b = bool, s = string
CHUNK_ATTRS = [
    ("kvtrace.step", "step", "i"), ("kvtrace.chunk.index", "chunk_index", "i"), ("kvtrace.chunk.attempt", "attempt", "i"),
    ("kvtrace.chunk.token_start", "token_start", "i"), ("kvtrace.chunk.token_end", "token_end", "i"),
    ("kvtrace.chunk.tokens", "tokens", "i"), ("kvtrace.chunk.last", "last", "b"), ("kvtrace.chunk.resumed", "resumed", "b"),
    ("kvtrace.chunk.cached_tokens", "cached_tokens", "i"), ("kvtrace.chunk.cached_local_tokens", "cached_local", "i"),
    ("kvtrace.chunk.cached_external_tokens", "cached_external", "i"), ("kvtrace.chunk.hit_blocks", "hit_blocks", "i"),
    ("kvtrace.chunk.evicted_blocks", "evicted_blocks", "i"), ("kvtrace.chunk.load_bytes", "load_bytes", "i"),
    ("kvtrace.chunk.load_blocks", "load_blocks", "i"), ("kvtrace.chunk.load_ns", "load_ns", "i"),
    ("kvtrace.chunk.storage_wait_ns", "storage_wait_ns", "i"), ("kvtrace.chunk.compute_ns", "compute_ns", "i"),
    ("kvtrace.chunk.sched_ns", "sched_ns", "i"), ("kvtrace.chunk.bottleneck", "bottleneck", "s"),
    ("kvtrace.chunk.shared_file_bytes", "shared_file_bytes", "i"),
    ("kvtrace.chunk.shared_block_bytes", "shared_block_bytes", "i"), ("kvtrace.step.tokens", "step_tokens", "i"),
    ("kvtrace.chunk.nvme_commands", "nvme_commands", "d"), ("kvtrace.chunk.nvme_bytes", "nvme_bytes", "d"),
    ("kvtrace.chunk.nvme_latency_avg_ns", "nvme_latency_avg_ns", "d"),
    ("kvtrace.chunk.nvme_latency_max_ns", "nvme_latency_max_ns", "i"),
    *((f"kvtrace.miss.{c.removeprefix('miss_')}", c, "i") for c in MISSES),
    ("process.pid", "engine_pid", "i"),
]
REQUEST_ATTRS = [
    ("gen_ai.usage.input_tokens", "prompt_len", "i"), ("gen_ai.usage.cache_read.input_tokens", "cached_tokens", "i"),
    ("kvtrace.request.cached_tokens", "cached_tokens", "i"),
    ("kvtrace.request.cached_local_tokens", "cached_local", "i"),
    ("kvtrace.request.cached_external_tokens", "cached_external", "i"),
    ("kvtrace.request.admissions", "admissions", "i"), ("kvtrace.request.preemptions", "preemptions", "i"),
    ("kvtrace.request.chunks", "chunks", "i"), ("kvtrace.request.evicted_blocks", "evicted_blocks", "i"),
    ("kvtrace.request.load_bytes", "load_bytes", "i"), ("kvtrace.request.storage_wait_ns", "storage_wait_ns", "i"),
    ("kvtrace.request.compute_ns", "compute_ns", "i"), ("kvtrace.request.queue_ns", "queue_ns", "i"),
    ("kvtrace.request.finished", "finished", "b"), ("kvtrace.trace.joined", "joined_trace", "b"),
    *((f"kvtrace.miss.{c.removeprefix('miss_')}", c, "i") for c in MISSES),
    ("kvtrace.miss.readmit_recomputed", "readmit_recomputed_tokens", "i"),
    ("kvtrace.request.kv_connector", "kv_connector", "s"),
    ("kvtrace.request.connector_load_tokens", "connector_load_tokens", "i"),
    ("kvtrace.request.connector_load_bytes", "connector_load_bytes", "i"),
    ("kvtrace.request.connector_load_wait_ns", "connector_load_wait_ns", "i"),
    ("process.pid", "engine_pid", "i"),
]


def _codes(values: list[str]) -> tuple[list[int], list[str]]:
    index: dict[str, int] = {}
    codes = [index.setdefault(v, len(index)) for v in values]
    return codes, list(index)


def encoded_chunk_spans(res, trace_of, offset: int) -> list[bytes]:
    import numpy as np


    ch = res.chunks
    n = ch.num_rows
    if not n:
        return []
    ev_by_chunk = _chunk_events_encoded(res, offset)
    col = lambda c: ch[c].to_numpy(zero_copy_only=False)  # noqa: E731
    req = ch["request"].to_pylist()
    rcodes, rvals = _codes(req)
    bcodes, bvals = _codes(ch["bottleneck"].to_pylist())
    attrs = [("kvtrace.request.id", "s", (rcodes, rvals)),
             ("gen_ai.request.id", "s", (rcodes, [ids.external_id(r) for r in rvals]))]
    for key, c, kind in CHUNK_ATTRS:
        attrs.append((key, kind, (bcodes, bvals) if c == "bottleneck" else col(c)))
    extra = None
    states = {r: trace_of(r)[3] for r in rvals}
    if ev_by_chunk or any(states.values()):
        attempts, steps = ch["attempt"].to_pylist(), ch["step"].to_pylist()
        extra = []
        for i in range(n):
            evs = ev_by_chunk.get((req[i], attempts[i], steps[i]))
            state = states[req[i]]
            if not evs and not state:
                extra.append(b"")
                continue
            parts = []
            if evs:
                if len(evs) > 1:
                    evs.sort(key=lambda e: (e[0], e[1]))
                parts = [e[2] for e in evs[:MAX_EVENTS]]
                if len(evs) > MAX_EVENTS:
                    parts.append(b"\x60" + encode.varint(len(evs) - MAX_EVENTS))
            if state:
                parts.append(encode.tail((), 0, False, state))
            extra.append(b"".join(parts))
    start = col("t_start_ns").astype(np.uint64) + np.uint64(offset)
    end = col("t_end_ns").astype(np.uint64) + np.uint64(offset)
    return encode.spans_columnar("kvtrace.prefill_chunk", ch["trace_id"].to_pylist(), ch["span_id"].to_pylist(),
                                 ch["parent_span_id"].to_pylist(), start, end, attrs, extra)


def encoded_request_spans(rows: list[dict], accs: list, offset: int) -> list[bytes]:
    import numpy as np


    if not rows:
        return []
    req = [r["request"] for r in rows]
    rcodes, rvals = _codes(req)
    attrs = [("kvtrace.request.id", "s", (rcodes, rvals)),
             ("gen_ai.request.id", "s", (rcodes, [ids.external_id(v) for v in rvals]))]
    for key, c, kind in REQUEST_ATTRS:
        vals = [r[c] for r in rows]
        attrs.append((key, kind, _codes(vals) if kind == "s" else np.array(vals, np.int64 if kind == "i" else bool)))
    extra = []
    for r, a in zip(rows, accs):
        evs, dropped = request_events(a, offset)
        state = a.arrive["tracestate"] if a.arrive and r["joined_trace"] else ""
        extra.append(encode.tail(evs, dropped, False, state))
    start = np.array([r["start_ns"] for r in rows], np.uint64) + np.uint64(offset)
    end = np.array([r["end_ns"] for r in rows], np.uint64) + np.uint64(offset)
    return encode.spans_columnar("kvtrace.request", [r["trace_id"] for r in rows], [r["span_id"] for r in rows],
                                 [r["parent_span_id"] for r in rows], start, end, attrs, extra)


def _chunk_events_encoded(res, offset: int) -> dict:
    """(request, attempt, step) -> [(time, name, encoded event)]: the events of _chunk_events, encoded."""

    out: dict[tuple, list] = {}
    for e in res.evicts:
        if e["chunk"] is not None:
            t = e["t_ns"] + offset
            out.setdefault((e["request"],) + e["chunk"], []).append(
                (t, "kvtrace.evict", encode.evict_event(t, e["block_hash"], e["block_id"], e["group"], e["medium"])))
    for p in res.preempts:
        if p["for_chunk"] is not None:
            t = p["t_ns"] + offset
            out.setdefault((p["for_request"],) + p["for_chunk"], []).append(
                (t, "kvtrace.preempt", encode.event(t, "kvtrace.preempt", (
                    ("kvtrace.preempt.victim", p["request"]), ("kvtrace.preempt.computed_tokens", p["computed_before"]),
                    ("kvtrace.preempt.num_tokens", p["num_tokens"])))))
    return out


def encoded_other_spans(res, trace_of, offset: int) -> list[bytes]:
    """Transfer and kernel I/O spans (fewer): the Span path."""

    res_no_chunks = _NoChunks(res)
    return [encode.span(s) for s in chunk_spans(res_no_chunks, trace_of, offset)]


class _NoChunks:
    """A view of a Result without its chunks (chunk_spans then builds only transfers and I/O)."""

    def __init__(self, res):
        import pyarrow as pa

        self.evicts, self.preempts = [], []
        self.chunks = pa.table({})
        self.transfers, self.io_groups = res.transfers, res.io_groups
        self.nvme_groups = getattr(res, "nvme_groups", [])
