"""The correlator on event sequences with known answers (no root).

The hand-built run below has every case the rules name: a chunk waiting on a connector load read
block by block on the worker's thread (thread+time), I/O of another thread (shared by token
share), a socket read (not storage), two overlapping steps (async scheduling), a preemption
and re-admission, NVMe commands and NIC counter deltas overlapping steps, and I/O outside every
step.  Each expected number is worked out by hand in the comments.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvtrace.correlate import core, ids, synthetic
from kvtrace.correlate.derive import correlate_tables
from kvtrace.correlate.live import LiveCorrelator
from kvtrace.correlate.requests import Requests, requests_table
from kvtrace.dataset import schema

E, W = 100, 200          # EngineCore and Worker pids
LOADER, OTHER = 201, 202  # worker threads
A, B, C = "cmpl-A-0-aaaaaaaa", "cmpl-B-0-bbbbbbbb", "cmpl-C-0-cccccccc"
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
MS = 1_000_000


def step(n, t0, ts, te, total, **kw):
    return dict(step=n, t_start_ns=t0, t_sched_end_ns=ts, t_end_ns=te, total_tokens=total, pid=E, tid=E, **kw)


def chunk(n, r, attempt, idx, start, length, prompt, last=0, resumed=0):
    return dict(step=n, request=r, attempt=attempt, chunk_index=idx, start=start, length=length, prompt_len=prompt,
                prefill_len=prompt, last=last, resumed=resumed, pid=E, tid=E)


def fio(t0, t1, nbytes, tid=LOADER, path="/kv/blk", syscall="preadv2"):
    return dict(start_ns=t0, ts_ns=t1, pid=W, tid=tid, syscall=syscall, path=path, bytes=nbytes, ret=nbytes,
                latency_ns=t1 - t0)


def run_tables() -> dict[str, pa.Table]:
    T = synthetic.table
    return {
        "step": T("step", [
            step(1, 1 * MS, 1 * MS + 10_000, 1 * MS + 500_000, 256, prefill_tokens=256, prefill_reqs=2),
            # S2 and S3 overlap (async scheduling): S3 is scheduled before S2's output is processed
            step(2, 2 * MS, 2 * MS + 10_000, 2 * MS + 600_000, 200, prefill_tokens=200, prefill_reqs=1),
            step(3, 2 * MS + 400_000, 2 * MS + 410_000, 3 * MS, 100, prefill_tokens=100, prefill_reqs=1),
            step(4, 3 * MS + 100_000, 3 * MS + 110_000, 3 * MS + 400_000, 100, prefill_tokens=100, prefill_reqs=1),
            step(5, 4 * MS, 4 * MS + 10_000, 4 * MS + 300_000, 13, prefill_tokens=12, prefill_reqs=1),
            step(6, 4 * MS + 400_000, 4 * MS + 410_000, 4 * MS + 500_000, 1),
        ]),
        "chunk": T("chunk", [
            chunk(1, A, 0, 0, 64, 192, 456), chunk(1, B, 0, 0, 0, 64, 64, last=1),
            chunk(2, A, 0, 1, 256, 200, 456, last=1),
            chunk(3, C, 0, 0, 0, 100, 200),
            chunk(4, C, 0, 1, 100, 100, 200, last=1),
            chunk(5, A, 1, 0, 448, 12, 460, last=1, resumed=1),
        ]),
        "admit": T("admit", [
            dict(step=1, request=A, attempt=0, prompt_len=456, prefill_len=456, cached_local=32, cached_external=32,
                 start=64, hit_blocks=1, pid=E),
            dict(step=1, request=B, attempt=0, prompt_len=64, prefill_len=64, pid=E),
            dict(step=3, request=C, attempt=0, prompt_len=200, prefill_len=200, pid=E),
            dict(step=5, request=A, attempt=1, prompt_len=456, prefill_len=460, cached_local=448, start=448,
                 hit_blocks=14, resumed=1, pid=E),
        ]),
        "arrive": T("arrive", [
            dict(step=1, t_ns=900_000, request=A, traceparent=TP, tracestate="k=v", pid=E),
            dict(step=1, t_ns=950_000, request=B, pid=E),
            dict(step=3, t_ns=2 * MS, request=C, pid=E),
        ]),
        "finish": T("finish", [dict(step=2, t_ns=2 * MS + 1000, request=B, pid=E),
                               dict(step=6, t_ns=4 * MS + 400_000, request=A, pid=E)]),
        "evict": T("evict", [
            dict(step=1, t_ns=1 * MS + 5000, block_hash=0xFFFF_0000_0000_0001, block_id=7, medium="GPU", request=A, pid=E),
            dict(step=1, t_ns=1 * MS + 5001, block_hash=2, block_id=8, medium="GPU", request=A, pid=E),
            dict(step=1, t_ns=1 * MS + 5002, block_hash=3, block_id=9, medium="GPU", request="", pid=E),
            dict(step=4, t_ns=3 * MS + 105_000, block_hash=4, block_id=10, medium="GPU", request=C, pid=E),
        ]),
        "preempt": T("preempt", [dict(step=4, t_ns=3 * MS + 104_000, request=A, computed_before=456, num_tokens=460,
                                      num_preemptions=1, for_request=C, pid=E)]),
        "kv_load": T("kv_load", [
            # A's load, reported by the connector with its request id
            dict(t_start_ns=1 * MS + 20_000, t_end_ns=1 * MS + 120_000, t_issue_end_ns=1 * MS + 120_000, blocks=2,
                 nbytes=131072, request=A, source="kvtrace-file", pid=W, tid=LOADER),
            # the hook's per-step connector record around it (no request), 5 µs of layer waits after
            dict(t_start_ns=1 * MS + 15_000, t_end_ns=1 * MS + 130_000, t_issue_end_ns=1 * MS + 125_000, seq=1,
                 layer_waits=2, wait_ns=5_000, source="connector:KvtraceFileConnector", pid=W, tid=LOADER),
        ]),
        "file_io": T("file_io", [
            fio(1 * MS + 30_000, 1 * MS + 60_000, 65536, path="/kv/a0"),   # thread+time -> A's load
            fio(1 * MS + 70_000, 1 * MS + 100_000, 65536, path="/kv/a1"),  # thread+time -> A's load
            fio(1 * MS + 200_000, 1 * MS + 201_000, 4096, tid=OTHER, path="/var/lib/x", syscall="read"),  # shared, S1
            fio(1 * MS + 210_000, 1 * MS + 211_000, 999, tid=OTHER, path="socket:[77]", syscall="read"),  # not storage
            fio(2 * MS + 500_000, 2 * MS + 501_000, 8192, tid=OTHER, path="/var/lib/x", syscall="read"),  # S2 and S3
            fio(2 * MS + 700_000, 2 * MS + 701_000, 512, tid=OTHER, path="/var/lib/x", syscall="read"),   # S3 only
            fio(5 * MS, 5 * MS + 1000, 100, tid=OTHER, path="/var/lib/x", syscall="read"),               # no step
        ]),
        "block_io": T("block_io", [
            dict(start_ns=1 * MS + 31_000, ts_ns=1 * MS + 90_000, pid=W, tid=LOADER, disk="nvme0n1", bytes=131072,
                 op="R", latency_ns=59_000, queue_ns=1000, device_ns=58_000),
            dict(start_ns=1 * MS + 300_000, ts_ns=1 * MS + 350_000, pid=W, tid=OTHER, disk="nvme0n1", bytes=4 << 20,
                 op="W", latency_ns=50_000),
        ]),
        # 2 commands (sampling weight) of 4096 bytes, half of their interval inside S1
        "nvme_cmd": T("nvme_cmd", [dict(ts_ns=1 * MS + 600_000, setup_ns=1 * MS + 400_000, bytes=4096, weight=2)]),
        # a counter polled at 2.5 ms with a 1 ms interval: [1.5, 2.5] ms overlaps S2 by 0.5 ms, S3 by 0.1 ms
        "nic_counters": T("nic_counters", [dict(ts_ns=2 * MS + 500_000, interval_ns=1 * MS, device="mlx5_0",
                                               name="port_rcv_data", delta=1000)]),
    }


@pytest.fixture(scope="module")
def out():
    res, accs, req, traces = correlate_tables(run_tables(), "run1")
    return res, {r["request"]: r for r in req.to_pylist()}


def chunks_of(res):
    return {(c["request"], c["attempt"], c["chunk_index"]): c for c in res.chunks.to_pylist()}


def steps_of(res):
    return {s["step"]: s for s in res.steps.to_pylist()}


def test_steps_storage_wait_shared_io_and_overlap(out):
    res, _ = out
    s = steps_of(res)
    assert sorted(s) == [1, 2, 3, 4, 5, 6]
    # S1: loads [1.020, 1.120] and the connector's [1.015, 1.125] (issue part) overlap: union 110 µs,
    # plus 5 µs of layer waits = 115 µs of storage wait; exec = 500 - 10 = 490 µs; compute 375 µs.
    assert (s[1]["exec_ns"], s[1]["storage_wait_ns"], s[1]["compute_ns"], s[1]["sched_ns"]) == (490_000, 115_000, 375_000, 10_000)
    assert s[1]["load_count"] == 2 and s[1]["load_bytes"] == 131072
    # storage reads in S1: the two block files and /var/lib/x (the socket is not storage)
    assert s[1]["file_read_bytes"] == 65536 * 2 + 4096 and s[1]["shared_file_bytes"] == 4096
    assert s[1]["block_read_bytes"] == 131072 and s[1]["block_write_bytes"] == 4 << 20
    assert s[1]["shared_block_bytes"] == 4 << 20
    assert s[1]["evicted_blocks"] == 3 and s[1]["chunks"] == 2 and s[1]["bottleneck"] == "compute"
    # the 8 KiB read at 2.5 ms lies in S2 [2.0, 2.6] and S3 [2.4, 3.0]: it goes to S2, the earliest
    assert s[2]["shared_file_bytes"] == 8192 and s[3]["shared_file_bytes"] == 512
    assert (s[2]["overlapping_steps"], s[3]["overlapping_steps"], s[1]["overlapping_steps"]) == (1, 1, 0)
    # NVMe: 2 commands x half the interval in S1; NIC: 1000 x 0.5 in S2, x 0.1 in S3
    assert s[1]["nvme_commands"] == pytest.approx(1.0) and s[1]["nvme_bytes"] == pytest.approx(4096.0)
    assert json.loads(s[2]["nic_deltas"]) == {"mlx5_0/port_rcv_data": pytest.approx(500.0)}
    assert json.loads(s[3]["nic_deltas"]) == {"mlx5_0/port_rcv_data": pytest.approx(100.0)}
    assert s[1]["nic_deltas"] == ""


def test_chunks(out):
    res, _ = out
    c = chunks_of(res)
    assert sorted(c) == [(A, 0, 0), (A, 0, 1), (A, 1, 0), (B, 0, 0), (C, 0, 0), (C, 0, 1)]
    a0 = c[(A, 0, 0)]
    assert (a0["token_start"], a0["token_end"], a0["tokens"]) == (64, 256, 192)
    assert (a0["cached_tokens"], a0["cached_local"], a0["cached_external"], a0["hit_blocks"]) == (64, 32, 32, 1)
    assert (a0["load_count"], a0["load_blocks"], a0["load_bytes"], a0["load_ns"]) == (1, 2, 131072, 100_000)
    assert (a0["file_read_bytes"], a0["block_read_bytes"], a0["evicted_blocks"]) == (131072, 131072, 2)
    # every chunk of a batched step waits for the step's storage; shared bytes split by tokens
    assert a0["storage_wait_ns"] == c[(B, 0, 0)]["storage_wait_ns"] == 115_000
    assert (a0["shared_file_bytes"], c[(B, 0, 0)]["shared_file_bytes"]) == (4096 * 192 // 256, 4096 * 64 // 256)
    assert (a0["shared_block_bytes"], c[(B, 0, 0)]["shared_block_bytes"]) == ((4 << 20) * 3 // 4, (4 << 20) // 4)
    assert c[(B, 0, 0)]["load_bytes"] == 0 and c[(B, 0, 0)]["cached_tokens"] == 0
    assert c[(A, 0, 1)]["cached_tokens"] == 0  # only an admission's first chunk had cache hits
    # C's second chunk's allocation evicted a block and preempted A
    assert (c[(C, 0, 1)]["evicted_blocks"], c[(C, 0, 1)]["preempted_others"]) == (1, 1)
    # A re-admitted: 448 tokens found cached again, recomputing 12
    a1 = c[(A, 1, 0)]
    assert (a1["resumed"], a1["cached_local"], a1["token_start"], a1["tokens"], a1["bottleneck"]) == (True, 448, 448, 12, "recompute")
    assert (a0["t_start_ns"], a0["t_end_ns"]) == (1 * MS, 1 * MS + 500_000)


def test_requests_and_trace_ids(out):
    _, r = out
    a = r[A]
    assert (a["admissions"], a["preemptions"], a["chunks"], a["prefill_tokens"]) == (2, 1, 3, 192 + 200 + 12)
    assert (a["cached_tokens"], a["readmit_cached_tokens"], a["evicted_blocks"], a["load_bytes"]) == (64, 448, 2, 131072)
    assert (a["arrival_ns"], a["first_scheduled_ns"], a["queue_ns"]) == (900_000, 1 * MS, 100_000)
    assert (a["finish_ns"], a["end_ns"], a["finished"]) == (4 * MS + 400_000, 4 * MS + 400_000, True)
    assert a["prefill_end_ns"] == 4 * MS + 300_000  # the re-admission's last chunk
    assert a["storage_wait_ns"] == 115_000 and a["external_id"] == "cmpl-A-0"
    # joined the caller's W3C trace: its trace id, the caller's span as parent
    assert (a["joined_trace"], a["trace_id"], a["parent_span_id"]) == (True, "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    b = r[B]
    assert b["joined_trace"] is False and b["parent_span_id"] == ""
    assert b["trace_id"] == ids.trace_of("run1", B)[0].hex()
    assert r[C]["finished"] is False and r[C]["end_ns"] == 3 * MS + 400_000


def test_attributions_record_how(out):
    res, _ = out
    rows = res.attributions.to_pylist()
    by = {(x["source"], x["start_ns"]): x for x in rows}
    f0 = by[("file_io", 1 * MS + 30_000)]
    assert (f0["how"], f0["request"], f0["step"], f0["chunk_index"], f0["transfer_start_ns"]) == \
        ("thread_time", A, 1, 0, 1 * MS + 20_000)
    assert by[("block_io", 1 * MS + 31_000)]["how"] == "thread_time"
    sh = by[("file_io", 1 * MS + 200_000)]
    assert (sh["how"], sh["request"], sh["step"], sh["chunk_index"]) == ("shared", "", 1, None)
    ov = by[("file_io", 2 * MS + 500_000)]
    assert (ov["how"], ov["step"], ov["candidates"]) == ("shared", 2, 2)
    out_of_steps = by[("file_io", 5 * MS)]
    assert (out_of_steps["how"], out_of_steps["step"]) == ("none", None)
    assert ("file_io", 1 * MS + 210_000) not in by  # the socket read is not storage I/O
    assert by[("kv_load", 1 * MS + 20_000)]["how"] == "exact_id"
    assert by[("kv_load", 1 * MS + 15_000)]["how"] == "shared"
    ev = [x for x in rows if x["source"] == "evict"]
    assert sorted((x["how"], x["request"]) for x in ev) == [("exact_id", A), ("exact_id", A), ("exact_id", C), ("shared", "")]
    nv = [x for x in rows if x["source"] == "nvme_cmd"]
    assert [(x["how"], x["step"], x["share"]) for x in nv] == [("time_overlap", 1, 0.5)]
    nic = sorted((x["step"], x["share"]) for x in rows if x["source"] == "nic_counters")
    assert nic == [(2, pytest.approx(0.5)), (3, pytest.approx(0.1))]
    assert set(res.attributions["how"].to_pylist()) <= set(core.HOW)


def test_derived_tables_match_the_documented_schema(out):
    res, r = out
    for name, t in (("chunks", res.chunks), ("steps", res.steps), ("attributions", res.attributions)):
        assert t.cast(schema.TABLES[name]).num_rows == t.num_rows
        assert [f.name for f in schema.TABLES[name]] == t.column_names
    accs = Requests("run1")
    assert [f.name for f in schema.TABLES["requests"]] == requests_table("run1", []).column_names


def test_locate_prefers_the_earliest_window():
    t0 = np.array([0, 10, 15, 30], np.uint64)
    t1 = np.array([9, 20, 25, 40], np.uint64)
    best, count = core.locate(np.array([5, 12, 17, 22, 27, 30, 50], np.uint64), t0, t1)
    assert best.tolist() == [0, 1, 1, 2, -1, 3, -1]
    assert count.tolist() == [1, 1, 2, 1, 0, 1, 0]


def test_traceparent_parsing():
    assert ids.parse_traceparent(TP)[0].hex() == "0af7651916cd43dd8448eb211c80319c"
    for bad in ("", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"):
        assert ids.parse_traceparent(bad) is None
    assert ids.external_id("cmpl-x-y-0-1a2b3c4d") == "cmpl-x-y-0"


def _slices(tables, n):
    """The run's rows in n flushes, each row in the flush after its record's time (chunk,
    admit and arrive records come with their step)."""
    step_end = dict(zip(tables["step"]["step"].to_pylist(), tables["step"]["t_end_ns"].to_pylist()))
    times = {}
    for name, t in tables.items():
        if name in ("chunk", "admit", "arrive"):
            times[name] = np.array([step_end.get(s, 0) for s in t["step"].to_pylist()], np.uint64)
        else:
            col = next(c for c in ("t_end_ns", "ts_ns", "t_ns") if c in t.column_names)
            times[name] = t[col].to_numpy()
    ends = np.concatenate(list(times.values()))
    cuts = list(np.linspace(ends.min(), ends.max(), n + 1)[1:-1].astype(np.uint64)) + [np.iinfo(np.uint64).max]
    prev = 0
    for c in cuts:
        yield int(c), {k: t.filter(pa.array((times[k] >= prev) & (times[k] < c))) for k, t in tables.items()}
        prev = c


@pytest.mark.parametrize("slices", [1, 7, 40])
def test_live_window_equals_offline(slices):
    tables = synthetic.workload(300, seed=slices)
    res, accs, req, _ = correlate_tables(tables, "r")
    live = LiveCorrelator("r", lateness_ns=0)
    got_chunks, got_steps, got_att, closed = [], [], [], []
    for now, batch in _slices(tables, slices):
        live.feed(batch)
        r, cl = live.advance(now if now < np.iinfo(np.uint64).max else None)
        got_chunks.append(r.chunks)
        got_steps.append(r.steps)
        got_att.append(r.attributions)
        closed += cl
    r, cl = live.advance(None)
    got_chunks.append(r.chunks)
    got_steps.append(r.steps)
    closed += cl
    key = lambda t, cols: t.sort_by([(c, "ascending") for c in cols]).to_pylist()  # noqa: E731
    assert key(pa.concat_tables(got_chunks), ["step", "request"]) == key(res.chunks, ["step", "request"])
    assert key(pa.concat_tables(got_steps), ["step"]) == key(res.steps, ["step"])
    assert requests_table("r", closed).to_pylist() == req.to_pylist()
    assert live.buffered() < 50  # everything decided was dropped from the window


def test_synthetic_known_totals():
    """The generator's own account of what it wrote against the correlator's sums."""
    tables = synthetic.workload(500, seed=3)
    res, _, req, _ = correlate_tables(tables, "r")
    loads = tables["kv_load"]
    assert sum(res.chunks["load_bytes"].to_pylist()) == sum(loads["nbytes"].to_pylist())
    assert sum(res.chunks["file_read_bytes"].to_pylist()) == sum(
        b for b, t in zip(tables["file_io"]["bytes"].to_pylist(), tables["file_io"]["tid"].to_pylist()) if t == 201)
    assert sum(res.chunks["evicted_blocks"].to_pylist()) == tables["evict"].num_rows
    assert sum(r["preemptions"] for r in req.to_pylist()) == tables["preempt"].num_rows
    assert req.num_rows == 500 and res.chunks.num_rows == tables["chunk"].num_rows
    assert sum(res.chunks["tokens"].to_pylist()) == sum(tables["chunk"]["length"].to_pylist())


# ---------------------------------------------------------------------------------------------
# A recorded capture of a real vLLM CPU server (tests/vllm/test_otlp.py, kept by
# tests/data/make_otlp_fixture.py) against vLLM's own numbers for each request.

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "vllm-otlp-capture"
FULL, BLOCK_BYTES = 31, 65536  # a 1000-token prompt's loadable blocks; 2 layers x K/V x 4 heads x 32 x 64 x bf16


@pytest.fixture(scope="module")
def recorded():
    if not FIXTURE.is_dir():
        pytest.skip(f"no recorded capture at {FIXTURE} (tests/data/make_otlp_fixture.py)")
    from kvtrace.correlate.derive import correlate_dataset, load_run

    (rc, _), = correlate_dataset(FIXTURE, write=False)
    usage = json.loads((FIXTURE / "vllm_usage.json").read_text())
    return rc, usage, load_run(FIXTURE, rc.info)


def test_recorded_capture_matches_vllms_numbers(recorded):
    rc, usage, tables = recorded
    reqs = {r["external_id"]: r for r in rc.requests.to_pylist()}
    assert set(reqs) == {f"cmpl-{n}-0" for n in usage}
    for name, u in usage.items():
        r = reqs[f"cmpl-{name}-0"]
        assert (r["prompt_len"], r["cached_tokens"]) == (u["prompt_tokens"], u["cached_tokens"]), name
        assert r["trace_id"] == u["traceparent"].split("-")[1] and r["joined_trace"] and r["finished"]
    chunks = {}
    for c in rc.result.chunks.to_pylist():
        chunks.setdefault(c["request"], []).append(c)
    for r in reqs.values():
        cs = sorted(chunks[r["request"]], key=lambda c: c["step"])
        assert cs[0]["token_start"] == r["cached_tokens"] and cs[-1]["token_end"] == r["prompt_len"]
        assert all(a["token_end"] == b["token_start"] for a, b in zip(cs, cs[1:]))
    # A2 reloaded A's 31 blocks from the file connector: the load names A2, and the kernel saw the
    # worker read 31 block files inside it, on its thread
    a2 = reqs["cmpl-A2-0"]
    assert (a2["cached_external"], a2["load_count"], a2["load_bytes"]) == (FULL * 32, 1, FULL * BLOCK_BYTES)
    (c0,) = [c for c in chunks[a2["request"]] if c["chunk_index"] == 0]
    assert c0["file_read_bytes"] == FULL * BLOCK_BYTES and c0["storage_wait_ns"] >= a2["load_ns"] > 0
    att = rc.result.attributions.to_pylist()
    reads = [x for x in att if x["source"] == "file_io" and x["request"] == a2["request"]]
    assert len(reads) == FULL and {x["how"] for x in reads} == {"thread_time"}
    # the evictions the hook recorded are all placed, on the request whose allocation caused them
    assert sum(r["evicted_blocks"] for r in reqs.values()) == tables["evict"].num_rows > 0


def test_recorded_capture_live_equals_offline(recorded):
    rc, _, tables = recorded
    live = LiveCorrelator(rc.info.run, lateness_ns=0)
    got, closed = [], []
    for now, batch in _slices(tables, 12):
        live.feed(batch)
        r, cl = live.advance(now if now < np.iinfo(np.uint64).max else None)
        got.append(r.chunks)
        closed += cl
    r, cl = live.advance(None)
    got.append(r.chunks)
    closed += cl
    key = lambda t: t.sort_by([("step", "ascending"), ("request", "ascending")]).to_pylist()  # noqa: E731
    assert key(pa.concat_tables(got)) == key(rc.result.chunks)
    assert requests_table(rc.info.run, closed).to_pylist() == rc.requests.to_pylist()
