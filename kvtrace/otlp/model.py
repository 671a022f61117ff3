"""The span model (docs/otlp.md): one trace per request.

    kvtrace.request                       arrival (or first schedule) -> finish; events: admit, preempted
      kvtrace.prefill_chunk               one per prefill chunk: its step's window; events: evict, preempt
        kvtrace.kv_load / kvtrace.kv_store  a connector transfer that names the request
          kvtrace.block_io / file_io / io_uring   the kernel I/O issued by that transfer's thread while
                                          it ran: one span per block I/O >= the size threshold, the rest
                                          aggregated per device and direction

A request that carried a W3C traceparent keeps its trace id; the request span's parent is the
caller's span (vLLM's llm_request span is its sibling).  Times are wall clock (monotonic + the
run's clock offset).  Attributes follow OpenTelemetry's gen_ai and system conventions where one
fits (gen_ai.request.id, gen_ai.usage.input_tokens, process.pid, thread.id, system.device,
disk.io.direction) and use the ``kvtrace.`` namespace otherwise.
"""
from __future__ import annotations

from typing import NamedTuple

from kvtrace.correlate import ids
from kvtrace.correlate.requests import Acc

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
    evs = sorted(evs, key=lambda e: (e[0], e[1]))
    return tuple(evs[:MAX_EVENTS]), max(len(evs) - MAX_EVENTS, 0)


def chunk_spans(res, trace_of, offset: int) -> list[Span]:
    """Spans of the chunks finalised in one correlation pass, with their transfers and kernel I/O.

    trace_of(request) -> (trace id, parent span id, joined, tracestate)."""
    out: list[Span] = []
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
                    ("kvtrace.step", cols["step"][i]), ("kvtrace.chunk.index", cols["chunk_index"][i]),
                    ("kvtrace.chunk.attempt", cols["attempt"][i]),
                    ("kvtrace.chunk.token_start", cols["token_start"][i]),
                    ("kvtrace.chunk.token_end", cols["token_end"][i]), ("kvtrace.chunk.tokens", cols["tokens"][i]),
                    ("kvtrace.chunk.last", cols["last"][i]), ("kvtrace.chunk.resumed", cols["resumed"][i]),
                    ("kvtrace.chunk.cached_tokens", cols["cached_tokens"][i]),
                    ("kvtrace.chunk.cached_local_tokens", cols["cached_local"][i]),
                    ("kvtrace.chunk.cached_external_tokens", cols["cached_external"][i]),
                    ("kvtrace.chunk.hit_blocks", cols["hit_blocks"][i]),
                    ("kvtrace.chunk.evicted_blocks", cols["evicted_blocks"][i]),
                    ("kvtrace.chunk.load_bytes", cols["load_bytes"][i]),
                    ("kvtrace.chunk.load_blocks", cols["load_blocks"][i]),
                    ("kvtrace.chunk.load_ns", cols["load_ns"][i]),
                    ("kvtrace.chunk.storage_wait_ns", cols["storage_wait_ns"][i]),
                    ("kvtrace.chunk.compute_ns", cols["compute_ns"][i]),
                    ("kvtrace.chunk.sched_ns", cols["sched_ns"][i]),
                    ("kvtrace.chunk.bottleneck", cols["bottleneck"][i]),
                    ("kvtrace.chunk.shared_file_bytes", cols["shared_file_bytes"][i]),
                    ("kvtrace.chunk.shared_block_bytes", cols["shared_block_bytes"][i]),
                    ("kvtrace.step.tokens", cols["step_tokens"][i]),
                    ("process.pid", cols["engine_pid"][i]),
                ), evs, state, dropped))
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
        out.append(Span(trace, ids.io_span(parent, *key), parent, f"kvtrace.{g['kind']}", g["start_ns"] + offset,
                        g["end_ns"] + offset, tuple(attrs), (), state, 0, g["errors"] > 0))
    return out


def request_span(row: dict, acc: Acc, offset: int) -> Span:
    r = row["request"]
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
    evs, dropped = _events(evs)
    state = acc.arrive["tracestate"] if acc.arrive and row["joined_trace"] else ""
    return Span(bytes.fromhex(row["trace_id"]), bytes.fromhex(row["span_id"]),
                bytes.fromhex(row["parent_span_id"]) if row["parent_span_id"] else b"", "kvtrace.request",
                row["start_ns"] + offset, row["end_ns"] + offset, (
                    ("kvtrace.request.id", r), ("gen_ai.request.id", row["external_id"]),
                    ("gen_ai.usage.input_tokens", row["prompt_len"]),
                    ("kvtrace.request.cached_tokens", row["cached_tokens"]),
                    ("kvtrace.request.cached_local_tokens", row["cached_local"]),
                    ("kvtrace.request.cached_external_tokens", row["cached_external"]),
                    ("kvtrace.request.admissions", row["admissions"]),
                    ("kvtrace.request.preemptions", row["preemptions"]),
                    ("kvtrace.request.chunks", row["chunks"]),
                    ("kvtrace.request.evicted_blocks", row["evicted_blocks"]),
                    ("kvtrace.request.load_bytes", row["load_bytes"]),
                    ("kvtrace.request.storage_wait_ns", row["storage_wait_ns"]),
                    ("kvtrace.request.compute_ns", row["compute_ns"]),
                    ("kvtrace.request.queue_ns", row["queue_ns"]),
                    ("kvtrace.request.finished", row["finished"]),
                    ("kvtrace.trace.joined", row["joined_trace"]),
                    ("process.pid", row["engine_pid"]),
                ), evs, state, dropped)
