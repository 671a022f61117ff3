"""NVMe commands in the derived tables and spans: the chunk that waited on them (every chunk of
the step they overlap), their queue latency as chunk attributes and `kvtrace.nvme` child
spans, and commands issued by a KV transfer's thread as `kvtrace.nvme_cmd` children of that
transfer.  A hand-built run; every number is worked out in the comments.  No root."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvtrace.correlate import ids, synthetic
from kvtrace.correlate.derive import correlate_tables
from kvtrace.correlate.live import LiveCorrelator
from kvtrace.otlp import encode
from kvtrace.otlp.sink import encoded_spans_of_pass, spans_of_pass

E, W, LOADER = 100, 200, 201
A, B = "cmpl-A-0-aaaaaaaa", "cmpl-B-0-bbbbbbbb"
MS, US = 1_000_000, 1_000
OFFSET = 1_700_000_000 * 10**9


def step(n, t0, ts, te, total):
    return dict(step=n, t_start_ns=t0, t_sched_end_ns=ts, t_end_ns=te, total_tokens=total, prefill_tokens=total,
                prefill_reqs=1, pid=E, tid=E)


def chunk(n, r, idx, start, length, prompt, last=0):
    return dict(step=n, request=r, attempt=0, chunk_index=idx, start=start, length=length, prompt_len=prompt,
                prefill_len=prompt, last=last, pid=E, tid=E)


def cmd(setup, done, ctrl, qid, transport, nbytes, weight=1, pid=0, tid=0):
    return dict(ts_ns=done, setup_ns=setup, latency_ns=done - setup, pid=pid, tid=tid, ctrl=ctrl, ctrl_id=int(ctrl[4:]),
                transport=transport, traddr="10.0.0.2:4420" if transport == "tcp" else "0000:00:04.0", qid=qid,
                opclass="read", op="read", opcode=2, bytes=nbytes, status=0, weight=weight)


def tables() -> dict[str, pa.Table]:
    T = synthetic.table
    return {
        # S1 [1.0, 1.5] ms with A's first chunk (192 tokens) and B's (64); S2 [2.0, 2.6] with A's second
        "step": T("step", [step(1, 1 * MS, 1 * MS + 10 * US, 1 * MS + 500 * US, 256),
                           step(2, 2 * MS, 2 * MS + 10 * US, 2 * MS + 600 * US, 200)]),
        "chunk": T("chunk", [chunk(1, A, 0, 0, 192, 392), chunk(1, B, 0, 0, 64, 64, last=1),
                             chunk(2, A, 1, 192, 200, 392, last=1)]),
        "admit": T("admit", [dict(step=1, request=A, attempt=0, prompt_len=392, prefill_len=392, pid=E),
                             dict(step=1, request=B, attempt=0, prompt_len=64, prefill_len=64, pid=E)]),
        # A's load [1.02, 1.12] ms on the worker's loader thread
        "kv_load": T("kv_load", [dict(t_start_ns=1 * MS + 20 * US, t_end_ns=1 * MS + 120 * US,
                                      t_issue_end_ns=1 * MS + 120 * US, blocks=1, nbytes=65536, request=A,
                                      source="kvtrace-file", pid=W, tid=LOADER)]),
        "nvme_cmd": T("nvme_cmd", [
            # issued by the loader thread during A's load (the block layer's issuer): 50 µs
            cmd(1 * MS + 30 * US, 1 * MS + 80 * US, "nvme1", 2, "tcp", 65536, pid=W, tid=LOADER),
            # a sampled row standing for 2 commands, issuer unknown: 100 µs, inside S1
            cmd(1 * MS + 200 * US, 1 * MS + 300 * US, "nvme1", 2, "tcp", 65536, weight=2),
            # 200 µs, half of it inside S1
            cmd(1 * MS + 400 * US, 1 * MS + 600 * US, "nvme0", 1, "pcie", 4096),
            # 100 µs inside S2
            cmd(2 * MS + 100 * US, 2 * MS + 200 * US, "nvme1", 2, "tcp", 8192),
        ]),
    }


@pytest.fixture(scope="module")
def out():
    res, accs, req, traces = correlate_tables(tables(), "run1")
    return res, accs, traces


def test_chunks_carry_the_nvme_commands_of_their_step(out):
    res, _, _ = out
    c = {(x["request"], x["chunk_index"]): x for x in res.chunks.to_pylist()}
    # S1: 1 + 2 + 0.5 (half the pcie command's interval) commands; 65536 + 2 x 65536 + 4096 / 2 bytes;
    # latency over the commands overlapping S1, by weight: (50 + 2 x 100 + 200) / 4 = 112.5 µs, max 200 µs
    for key in ((A, 0), (B, 0)):
        x = c[key]
        assert (x["nvme_commands"], x["nvme_bytes"]) == (pytest.approx(3.5), pytest.approx(198656.0))
        assert (x["nvme_latency_avg_ns"], x["nvme_latency_max_ns"]) == (pytest.approx(112_500.0), 200_000)
    a1 = c[(A, 1)]
    assert (a1["nvme_commands"], a1["nvme_bytes"], a1["nvme_latency_avg_ns"], a1["nvme_latency_max_ns"]) == (
        pytest.approx(1.0), pytest.approx(8192.0), pytest.approx(100_000.0), 100_000)
    s = {x["step"]: x for x in res.steps.to_pylist()}
    assert s[1]["nvme_commands"] == pytest.approx(3.5) and s[2]["nvme_bytes"] == pytest.approx(8192.0)


def test_attributions_say_how(out):
    res, _, _ = out
    rows = [r for r in res.attributions.to_pylist() if r["source"] == "nvme_cmd"]
    over = sorted((r["start_ns"], r["step"], r["share"]) for r in rows if r["how"] == "time_overlap")
    assert over == [(1 * MS + 30 * US, 1, 1.0), (1 * MS + 200 * US, 1, 1.0), (1 * MS + 400 * US, 1, 0.5),
                    (2 * MS + 100 * US, 2, 1.0)]
    (th,) = [r for r in rows if r["how"] == "thread_time"]
    assert (th["request"], th["chunk_index"], th["step"], th["tid"], th["bytes"], th["transfer_start_ns"]) == (
        A, 0, 1, LOADER, 65536, 1 * MS + 20 * US)


def test_spans_nvme_children_of_chunks_and_of_the_transfer(out):
    res, accs, traces = out
    spans = spans_of_pass(res, accs, lambda r: traces[r], "run1", OFFSET)
    by = {}
    for sp in spans:
        by.setdefault(sp.name, []).append(sp)
    chunk_ids = {(dict(sp.attrs)["kvtrace.request.id"], dict(sp.attrs)["kvtrace.step"]): sp for sp in by["kvtrace.prefill_chunk"]}
    # S1: 2 queues x 2 chunks; S2: 1 queue x 1 chunk
    nv = by["kvtrace.nvme"]
    assert len(nv) == 5
    got = sorted((sp.parent_id, dict(sp.attrs)["kvtrace.nvme.ctrl"]) for sp in nv)
    want = sorted([(chunk_ids[(A, 1)].span_id, "nvme0"), (chunk_ids[(A, 1)].span_id, "nvme1"),
                   (chunk_ids[(B, 1)].span_id, "nvme0"), (chunk_ids[(B, 1)].span_id, "nvme1"),
                   (chunk_ids[(A, 2)].span_id, "nvme1")])
    assert got == want
    tcp1 = next(sp for sp in nv if sp.parent_id == chunk_ids[(B, 1)].span_id and dict(sp.attrs)["kvtrace.nvme.ctrl"] == "nvme1")
    a = dict(tcp1.attrs)
    # 1 + 2 commands; 65536 + 2 x 65536 bytes; latency 50 + 2 x 100 µs, avg 250 / 3 µs
    assert (a["kvtrace.io.count"], a["kvtrace.nvme.samples"], a["kvtrace.io.bytes"], a["kvtrace.io.latency_ns_sum"],
            a["kvtrace.io.latency_ns_max"]) == (3, 2, 196608, 250_000, 100_000)
    assert a["kvtrace.nvme.latency_ns_avg"] == pytest.approx(250_000 / 3)
    assert (a["kvtrace.nvme.qid"], a["kvtrace.nvme.transport"], a["kvtrace.nvme.target"], a["kvtrace.attribution.how"]) == (
        2, "tcp", "10.0.0.2:4420", "time_overlap")
    assert (tcp1.start, tcp1.end) == (OFFSET + 1 * MS + 30 * US, OFFSET + 1 * MS + 300 * US)
    pcie = next(sp for sp in nv if sp.parent_id == chunk_ids[(B, 1)].span_id and dict(sp.attrs)["kvtrace.nvme.ctrl"] == "nvme0")
    assert (pcie.start, pcie.end) == (OFFSET + 1 * MS + 400 * US, OFFSET + 1 * MS + 500 * US)   # clipped to the step
    assert tcp1.trace_id == chunk_ids[(B, 1)].trace_id and len({sp.span_id for sp in spans}) == len(spans)
    # the loader's command under A's load
    (load,) = by["kvtrace.kv_load"]
    (nc,) = by["kvtrace.nvme_cmd"]
    b = dict(nc.attrs)
    assert nc.parent_id == load.span_id and load.parent_id == chunk_ids[(A, 1)].span_id
    assert (b["kvtrace.io.count"], b["kvtrace.io.bytes"], b["kvtrace.nvme.ctrl"], b["kvtrace.attribution.how"]) == (
        1, 65536, "nvme1", "thread_time")
    assert (nc.start, nc.end) == (OFFSET + 1 * MS + 30 * US, OFFSET + 1 * MS + 80 * US)
    assert nc.span_id == ids.io_span(load.span_id, "nvme_cmd", "nvme1 q2 read", True, "agg")


def test_columnar_encoding_equals_the_span_path_with_nvme(out):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.otlp_receiver import Received

    res, accs, traces = out
    ref = [encode.span(s) for s in spans_of_pass(res, accs, lambda r: traces[r], "run1", OFFSET)]
    got = encoded_spans_of_pass(res, accs, lambda r: traces[r], "run1", OFFSET)
    a, b = Received(), Received()
    a.add_traces(ExportTraceServiceRequest.FromString(encode.trace_request((), ref)), "x")
    b.add_traces(ExportTraceServiceRequest.FromString(encode.trace_request((), got)), "x")
    assert len(a.spans) == len(got) > 0
    assert sorted(s.key() for s in a.spans) == sorted(s.key() for s in b.spans)
    names = [s.name for s in b.spans]
    assert names.count("kvtrace.nvme") == 5 and names.count("kvtrace.nvme_cmd") == 1


@pytest.mark.parametrize("cut_ms", [1.05, 1.3, 2.15])
def test_live_window_gives_the_offline_nvme_columns(out, cut_ms):
    """The hook's records first, then the NVMe commands in two slices cut at cut_ms (by their
    completion): the live correlator decides the same chunk columns and NVMe spans as the
    offline pass, whichever pass a command arrives in (before its step is decided: live, the
    lateness of 2 flush intervals + 1 s sees to that; here lateness 0 and cuts before the
    step ends or after the command's end)."""
    res, _, _ = out
    t = tables()
    cut = int(cut_ms * MS)
    end = np.asarray(t["nvme_cmd"]["ts_ns"].to_pylist(), np.int64)
    first = {k: v for k, v in t.items() if k != "nvme_cmd"}
    first["nvme_cmd"] = t["nvme_cmd"].filter(pa.array(end < cut))
    live = LiveCorrelator("run1", lateness_ns=0)
    got, groups, io = [], [], []
    for batch, now in ((first, cut), ({"nvme_cmd": t["nvme_cmd"].filter(pa.array(end >= cut))}, None)):
        live.feed(batch)
        r, _ = live.advance(now)
        got.append(r.chunks)
        groups += [(g["step"], g["ctrl"], g["count"], g["bytes"], tuple(g["chunks"])) for g in r.nvme_groups]
        io += [(g["kind"], g["count"], g["bytes"]) for g in r.io_groups if g["kind"] == "nvme_cmd"]
    key = lambda tb: sorted(tb.to_pylist(), key=lambda x: (x["step"], x["request"]))  # noqa: E731
    assert key(pa.concat_tables(got)) == key(res.chunks)
    assert sorted(groups) == sorted((g["step"], g["ctrl"], g["count"], g["bytes"], tuple(g["chunks"])) for g in res.nvme_groups)
    assert io == [("nvme_cmd", 1, 65536)]
