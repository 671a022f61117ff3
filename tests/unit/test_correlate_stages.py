"""Each stage of kvtrace.correlate.core.correlate alone (kvtrace.correlate.stages), on a tiny
hand-built run whose every expected number is worked out in the comments.  No root.

The run: one engine (pid E) and its worker (pid W, loader thread L, another thread O).

    S1 [1000, 2000]  schedule ends 1100  100 tokens: A chunk 0 (60 tokens), B chunk 0 (40, last)
    S2 [1500, 3000]  schedule ends 1600   50 tokens: A chunk 1 (40, last)   (overlaps S1: async)
    S3 [4000, 5000]  schedule ends 4100   10 tokens: C chunk 0 (10, re-admitted: attempt 1)
    step 9: its record is lost; D has a chunk there

    kv_load  A's load [1200, 1400] on L (named), 2 blocks, 8192 bytes
    kv_load  the per-step connector record [1150, 1500] on L (issue part to 1450, 30 ns of layer waits)
    kv_store unnamed [4200, 4300] on O
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvtrace.correlate import core, ids, synthetic
from kvtrace.correlate.inputs import Cols, columns
from kvtrace.correlate.stages import (attributions, chunk_table, chunks, context, evictions, nvme, overlap, requests,
                                      spans, steps, storage_io, transfers)
from kvtrace.correlate.stages.context import EXACT, NONE, SHARED, THREAD

E, W, L, O = 100, 200, 201, 202
A, B, C, D = "cmpl-A-0-aaaaaaaa", "cmpl-B-0-bbbbbbbb", "cmpl-C-0-cccccccc", "cmpl-D-0-dddddddd"
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
T = synthetic.table


def step(n, t0, ts, te, total):
    return dict(step=n, t_start_ns=t0, t_sched_end_ns=ts, t_end_ns=te, total_tokens=total, pid=E, tid=E)


def chunk(n, r, idx, start, length, prompt, attempt=0, last=0, resumed=0):
    return dict(step=n, request=r, attempt=attempt, chunk_index=idx, start=start, length=length, prompt_len=prompt,
                prefill_len=prompt, last=last, resumed=resumed, pid=E, tid=E)


def fio(t0, t1, nbytes, tid=O, path="/var/lib/x", syscall="read"):
    return dict(start_ns=t0, ts_ns=t1, pid=W, tid=tid, syscall=syscall, path=path, bytes=nbytes, ret=nbytes,
                latency_ns=t1 - t0)


def run() -> dict[str, pa.Table]:
    return {
        "step": T("step", [step(1, 1000, 1100, 2000, 100), step(2, 1500, 1600, 3000, 50),
                           step(3, 4000, 4100, 5000, 10)]),
        "chunk": T("chunk", [chunk(1, A, 0, 0, 60, 100), chunk(1, B, 0, 0, 40, 40, last=1),
                             chunk(2, A, 1, 60, 40, 100, last=1), chunk(3, C, 0, 5, 10, 15, attempt=1, resumed=1),
                             chunk(9, D, 0, 0, 8, 8)]),
        "admit": T("admit", [dict(step=1, request=A, attempt=0, cached_local=32, cached_external=16, hit_blocks=1, pid=E),
                             dict(step=1, request=B, attempt=0, pid=E),
                             dict(step=3, request=C, attempt=1, cached_local=5, hit_blocks=1, resumed=1, pid=E)]),
        "arrive": T("arrive", [dict(step=1, t_ns=900, request=A, pid=E), dict(step=1, t_ns=901, request=A, traceparent=TP,
                                                                              tracestate="k=v", pid=E),
                               dict(step=1, t_ns=950, request=B, pid=E)]),
        "finish": T("finish", [dict(step=1, t_ns=1990, request=B, pid=E), dict(step=3, t_ns=4990, request=A, pid=E)]),
        "evict": T("evict", [dict(step=1, t_ns=1050, block_hash=7, block_id=7, medium="GPU", request=A, pid=E),
                             dict(step=1, t_ns=1051, block_hash=8, block_id=8, medium="GPU", request="", pid=E),
                             dict(step=9, t_ns=9000, block_hash=9, block_id=9, medium="GPU", request=D, pid=E)]),
        "preempt": T("preempt", [dict(step=3, t_ns=4050, request=A, computed_before=100, num_tokens=101,
                                      num_preemptions=1, for_request=C, pid=E)]),
        "kv_load": T("kv_load", [
            dict(t_start_ns=1200, t_end_ns=1400, t_issue_end_ns=1400, blocks=2, nbytes=8192, request=A,
                 source="kvtrace-file", pid=W, tid=L),
            dict(t_start_ns=1150, t_end_ns=1500, t_issue_end_ns=1450, seq=1, layer_waits=2, wait_ns=30,
                 source="connector:KvtraceFileConnector", pid=W, tid=L)]),
        "kv_store": T("kv_store", [dict(t_start_ns=4200, t_end_ns=4300, t_issue_end_ns=4300, blocks=1, nbytes=4096,
                                        source="connector:KvtraceFileConnector", pid=W, tid=O)]),
        "file_io": T("file_io", [
            fio(1250, 1300, 4096, tid=L, path="/kv/a0", syscall="preadv2"),  # 0: in A's load and the connector's: A's
            fio(1450, 1460, 1024, tid=L, path="/kv/a1", syscall="preadv2"),  # 1: in the connector's record only
            fio(1700, 1710, 512),                                            # 2: S1 and S2: shared to S1
            fio(1800, 1810, 99, path="socket:[7]"),                          # 3: not storage
            fio(4250, 4260, 2048, syscall="pwrite64"),                       # 4: in the store, on its thread
            fio(6000, 6010, 100),                                            # 5: in no step
        ]),
        "block_io": T("block_io", [
            dict(start_ns=1260, ts_ns=1290, pid=W, tid=L, disk="nvme0n1", bytes=4096, op="R", latency_ns=30,
                 queue_ns=5, device_ns=25, sector=80),
            dict(start_ns=1270, ts_ns=1295, pid=W, tid=L, disk="nvme0n1", bytes=2 << 20, op="R", latency_ns=25,
                 queue_ns=5, device_ns=20, sector=160),
            dict(start_ns=4500, ts_ns=4600, pid=W, tid=O, disk="nvme0n1", bytes=8192, op="W", latency_ns=100)]),
        "io_uring": T("io_uring", [dict(submit_ns=0, ts_ns=4700, pid=W, tid=O, op="READV", bytes=300, res=300),
                                   dict(submit_ns=4710, ts_ns=4720, pid=W, tid=O, op="SEND", bytes=77, res=77)]),
    }


def nvme_table() -> pa.Table:
    def cmd(setup, done, weight=1, tid=0, ctrl="nvme0", qid=1, nbytes=4096, status=0):
        return dict(ts_ns=done, setup_ns=setup, latency_ns=done - setup, pid=W if tid else 0, tid=tid, ctrl=ctrl,
                    transport="pcie", traddr="0000:00:04.0", qid=qid, opclass="read", bytes=nbytes, status=status,
                    weight=weight)
    t = T("nvme_cmd", [
        cmd(1260, 1280, tid=L),                 # 0: issued by L during A's load: 20 ns, in S1
        cmd(1800, 2200, weight=2, qid=2),       # 1: 400 ns: half of it in S1, all of it in S2 (every window counts)
        cmd(2500, 2500, weight=0, status=3),    # 2: a point at 2500 in S2 only; weight 0 counts as 1
        cmd(4400, 4600, qid=2),                 # 3: untraced completion (latency null below): placed at its setup
    ])
    lat = t["latency_ns"].to_pylist()
    lat[3] = None
    return t.set_column(t.column_names.index("latency_ns"), "latency_ns", pa.array(lat, pa.int64()))


@pytest.fixture
def ctx():
    return context.context(run(), "r")


def placed(ctx):
    """The placement stages in order, as correlate() wires them."""
    ch = chunks.index_chunks(ctx)
    tr = transfers.kv_transfers(ctx, ch)
    kio = storage_io.storage_io(ctx, tr)
    return ch, tr, kio, evictions.evictions(ctx, ch), evictions.preemptions(ctx, ch)


# -- context -------------------------------------------------------------------------------------


def test_context_finalises_steps_ended_before_final_before():
    c = context.context(run(), "r", final_before=2500, horizon=9999)
    assert c.final.tolist() == [True, False, False]  # S1 ended at 2000; S2 at 3000, S3 at 5000
    assert int(c.horizon) == 2500                    # the horizon is at most final_before
    assert c.engines == [E]
    assert c.index.rows(np.array([E, E, 7]), np.array([2, 9, 1])).tolist() == [1, -1, -1]
    # a row with a step is final with it; without, when it starts before the horizon
    assert c.final_of(np.array([0, 1, -1, -1]), np.array([0, 0, 2499, 2500], np.uint64)).tolist() == [
        True, False, True, False]
    assert c.index.overlaps().tolist() == [1, 1, 0]  # S1 and S2 overlap each other
    # the earliest window holding a time, and how many held it
    pos, cand = c.index.locate(np.full(4, E, np.uint32), np.array([1700, 2500, 3500, 4000], np.uint64))
    assert (pos.tolist(), cand.tolist()) == ([0, 1, -1, 2], [2, 1, 0, 1])


def test_engine_map_with_several_engines_follows_forks():
    procs = columns(T("processes", [dict(pid=1, event="fork", child_pid=100), dict(pid=100, event="fork", child_pid=200),
                                    dict(pid=200, event="fork", child_pid=201), dict(pid=1, event="fork", child_pid=300),
                                    dict(pid=300, event="fork", child_pid=400), dict(pid=500, event="exit")]),
                    "processes")
    pids = np.array([200, 201, 400, 500, 100, 300], np.uint32)
    assert context.engine_map(pids, [100, 300], procs).tolist() == [100, 100, 300, 0, 100, 300]
    assert context.engine_map(pids, [100], procs).tolist() == [100] * 6  # one engine: every process
    assert context.engine_map(pids, [], procs).tolist() == [0] * 6


def test_thread_match_prefers_named_transfers():
    tr = Cols(pid=np.array([W, W, W], np.uint32), tid=np.array([L, L, O], np.uint32),
              t_start_ns=np.array([10, 5, 10], np.uint64), t_end_ns=np.array([20, 30, 20], np.uint64))
    tr.n = 3
    named = np.array([True, False, True])
    pid = np.array([W, W, W, W, W, W + 1], np.uint32)
    tid = np.array([L, L, L, O, O, L], np.uint32)
    t = np.array([15, 25, 40, 15, 15, 15], np.uint64)
    eligible = np.array([True, True, True, True, False, True])
    # 15 on L: inside the named 0 and the unnamed 1: named wins; 25: only the unnamed; 40: none;
    # O at 15: transfer 2 unless not eligible; another process's thread L: none
    assert context.thread_match(pid, tid, t, eligible, tr, named).tolist() == [0, 1, -1, 2, -1, -1]


# -- requests ------------------------------------------------------------------------------------


def test_trace_ids_from_arrive_records(ctx):
    tr = requests.trace_ids(ctx)
    assert tr.of(A) == ids.trace_of("r", A, TP)   # the record with a traceparent wins
    assert tr.of(A)[0].hex() == "0af7651916cd43dd8448eb211c80319c" and tr.of(A)[2] is True
    assert tr.of(B) == ids.trace_of("r", B, "") and tr.of(B)[2] is False
    assert C not in tr.by and tr.of(C) == ids.trace_of("r", C, "") and C in tr.by  # derived on first use


def test_request_records_only_final_admissions_and_finishes():
    c = context.context(run(), "r", final_before=2500)
    rec = requests.request_records(c, chunks.index_chunks(c))
    assert [(a["request"], a["step"], a["cached_local"], a["cached_external"]) for a in rec.admits] == [
        (A, 1, 32, 16), (B, 1, 0, 0)]                         # C's admission is in S3, not final
    assert [(a["request"], a["t_ns"], a["traceparent"]) for a in rec.arrives] == [(A, 900, ""), (A, 901, TP), (B, 950, "")]
    assert rec.finishes == [{"engine_pid": E, "request": B, "t_ns": 1990}]
    assert rec.finish_final.tolist() == [True, False]


# -- chunks --------------------------------------------------------------------------------------


def test_index_chunks():
    c = context.context(run(), "r", final_before=2500)
    ch = chunks.index_chunks(c)
    assert ch.at == {(E, 1, A): 0, (E, 1, B): 1, (E, 2, A): 2, (E, 3, C): 3, (E, 9, D): 4}
    assert ch.step.tolist() == [0, 0, 1, 2, -1]
    assert ch.final.tolist() == [True, True, False, False, True]   # D's step record is lost: final at once
    assert ch.admit_of == {(E, A, 0): 0, (E, B, 0): 1, (E, C, 1): 2}
    assert ch.admit_final.tolist() == [True, True, False]
    assert ch.rows(np.array([E, E, E]), np.array([1, 2, 3]), np.array([B, B, C], dtype=object)).tolist() == [1, -1, 3]


# -- transfers -----------------------------------------------------------------------------------


def test_kv_transfers(ctx):
    ch = chunks.index_chunks(ctx)
    tr = transfers.kv_transfers(ctx, ch)
    assert tr.n == 3 and tr.n_load == 2 and tr.tr["dir"].tolist() == ["load", "load", "store"]
    assert tr.step.tolist() == [0, 0, 2]
    assert tr.cand.tolist() == [1, 1, 1]            # 1200 and 1150 are before S2's start
    assert tr.chunk.tolist() == [0, -1, -1]         # A's load: A's chunk in S1
    assert tr.how.tolist() == [EXACT, SHARED, SHARED]
    assert tr.final.tolist() == [True, True, True]
    live = context.context(run(), "r", final_before=2500)
    assert transfers.kv_transfers(live, chunks.index_chunks(live)).final.tolist() == [True, True, False]


# -- storage I/O ---------------------------------------------------------------------------------


def test_storage_io_thread_time_shared_none(ctx):
    ch, tr, kio, _, _ = placed(ctx)
    f = kio["file_io"]
    assert f.storage.tolist() == [True, True, True, False, True, True]
    assert f.transfer.tolist() == [0, 1, -1, -1, 2, -1]   # A's load; the connector record; ...; the store
    assert f.step.tolist() == [0, 0, 0, -1, 2, -1]         # 1700 is in S1 and S2: the earliest
    assert f.cand.tolist() == [1, 1, 2, 2, 1, 0]
    assert f.how.tolist() == [THREAD, THREAD, SHARED, NONE, THREAD, NONE]
    b = kio["block_io"]
    assert (b.transfer.tolist(), b.step.tolist(), b.how.tolist()) == ([0, 0, -1], [0, 0, 2], [THREAD, THREAD, SHARED])
    u = kio["io_uring"]
    # READV without a submit time is placed at its completion; SEND is not storage I/O
    assert (u.t.tolist(), u.storage.tolist(), u.step.tolist(), u.how.tolist()) == (
        [4700, 4710], [True, False], [2, -1], [SHARED, NONE])
    assert f.final.tolist() == [True, True, True, True, True, True]


def test_storage_io_decided_and_step_bytes():
    c = context.context(run(), "r", final_before=2500)
    _, tr, kio, _, _ = placed(c)
    # final: rows of S1, and the socket read (not storage: no step) as it is before the horizon 2500
    assert kio["file_io"].final.tolist() == [True, True, True, True, False, False]
    assert kio["file_io"].decided(c.horizon).tolist() == [True, True, True, True, False, False]
    io = storage_io.step_io_bytes(3, storage_io.storage_io(context.context(run(), "r"), tr))
    assert {k: v.tolist() for k, v in io.items()} == {
        "file_read_bytes": [4096 + 1024 + 512, 0, 0], "file_write_bytes": [0, 0, 2048],
        "block_read_bytes": [4096 + (2 << 20), 0, 0], "block_write_bytes": [0, 0, 8192],
        "io_uring_bytes": [0, 0, 300], "shared_file_bytes": [512, 0, 300], "shared_block_bytes": [0, 0, 8192]}


# -- evictions and preemptions -------------------------------------------------------------------


def test_evictions_and_preemptions(ctx):
    ch = chunks.index_chunks(ctx)
    ev = evictions.evictions(ctx, ch)
    # the eviction in step 9 finds D's chunk there, though the step's record is lost
    assert (ev.step.tolist(), ev.chunk.tolist(), ev.final.tolist()) == ([0, 0, -1], [0, -1, 4], [True, True, True])
    pr = evictions.preemptions(ctx, ch)
    # A was preempted in S3 for C: C's chunk there; A has no chunk in S3
    assert (pr.step.tolist(), pr.for_chunk.tolist(), pr.chunk.tolist()) == ([2], [3], [-1])
    recs = evictions.evict_records(ev, ch)
    assert [(r["request"], r["block_id"], r["chunk"]) for r in recs] == [(A, 7, (0, 1)), ("", 8, None), (D, 9, (0, 9))]
    assert evictions.preempt_records(pr, ch) == [
        {"engine_pid": E, "step": 3, "t_ns": 4050, "request": A, "computed_before": 100, "num_tokens": 101,
         "num_preemptions": 1, "for_request": C, "for_chunk": (1, 3)}]
    live = context.context(run(), "r", final_before=2500, horizon=5000)
    # the lost step's eviction (9000) is after the horizon: not final yet
    assert evictions.evictions(live, chunks.index_chunks(live)).final.tolist() == [True, True, False]


# -- NVMe / NIC overlap --------------------------------------------------------------------------


def test_overlaps_share_by_overlapped_fraction():
    tables = run()
    tables["nvme_cmd"] = nvme_table()
    tables["nic_counters"] = T("nic_counters", [
        dict(ts_ns=2000, interval_ns=1000, device="mlx5_0", name="rx", delta=100),   # [1000, 2000]: S1 all, S2 half
        dict(ts_ns=4500, interval_ns=0, device="mlx5_0", name="tx", delta=7)])       # a point in S3
    c = context.context(tables, "r")
    ov = overlap.overlaps(c)
    # cmd 0 [1260, 1280]: S1 x1.  cmd 1 [1800, 2200] weight 2: S1 200/400, S2 all.  cmd 2 a point
    # at 2500 (weight 0 = 1): S2.  cmd 3 untraced: the table's [4400, 4600] in S3
    assert ov.nvme_cmds.tolist() == [1 + 2 * 0.5, 2 * 1.0 + 1, 1.0]
    assert ov.nvme_bytes.tolist() == [4096 + 2 * 0.5 * 4096, 2 * 4096 + 4096, 4096]
    assert ov.nic == [{"mlx5_0/rx": 100.0}, {"mlx5_0/rx": 50.0}, {"mlx5_0/tx": 7.0}]
    assert sorted(ov.nv_pairs) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 3)]
    assert [a for a in ov.attr if a[0] == "nic_counters"] == [("nic_counters", 2000, 1000, 0, 1.0),
                                                               ("nic_counters", 2000, 1000, 1, 0.5),
                                                               ("nic_counters", 4500, 4500, 2, 1.0)]
    assert {k: v.tolist() for k, v in ov.done.items()} == {"nvme_cmd": [True] * 4, "nic_counters": [True, True]}
    live = overlap.overlaps(context.context(tables, "r", final_before=2500))
    assert live.nvme_cmds.tolist() == [2.0, 0.0, 0.0]    # only S1 is final
    # decided: ended before the latest step's end (5000) and the horizon (2500)
    assert live.done["nvme_cmd"].tolist() == [True, True, False, False]


# -- NVMe commands -------------------------------------------------------------------------------


def test_nvme_rows_issuers_and_step_latency():
    tables = run()
    tables["nvme_cmd"] = nvme_table()
    c = context.context(tables, "r")
    nv = nvme.nvme_rows(tables["nvme_cmd"])
    assert nv["weight"].tolist() == [1, 2, 1, 1] and nv["timed"].tolist() == [True, True, True, False]
    assert nv["ts_ns"].tolist() == [1280, 2200, 2500, 4400]   # the untraced one ends at its setup
    ch, tr, _, _, _ = placed(c)
    n = nvme.nvme_commands(c, tr)
    assert n.transfer.tolist() == [0, -1, -1, -1] and n.pending.tolist() == [False] * 4
    s = nvme.step_nvme(c, n, overlap.overlaps(c), ch)
    # S1: cmd 0 (20 ns, w 1) and cmd 1 (400 ns, w 2): (20 + 800) / 3; S2: cmd 1 and cmd 2 (0 ns, w 1)
    assert s.latency_avg.tolist() == [820 / 3, 800 / 3, 0.0] and s.latency_max.tolist() == [400, 400, 0]
    got = [(g["step"], g["qid"], g["count"], g["samples"], g["start_ns"], g["end_ns"], g["chunks"]) for g in s.groups]
    assert got == [(1, 1, 1, 1, 1260, 1280, [(A, 0, 1), (B, 0, 1)]),
                   (1, 2, 2, 1, 1800, 2000, [(A, 0, 1), (B, 0, 1)]),     # clipped to S1's window
                   (2, 1, 1, 1, 2500, 2500, [(A, 0, 2)]),
                   (2, 2, 2, 1, 1800, 2200, [(A, 0, 2)]),
                   (3, 2, 1, 1, 4400, 4400, [(C, 1, 3)])]
    assert s.groups[1]["errors"] == 0 and s.groups[2]["errors"] == 1 and s.groups[4]["untraced"] == 1
    live = context.context(tables, "r", final_before=1000)   # A's load is not final yet
    assert nvme.nvme_commands(live, transfers.kv_transfers(live, chunks.index_chunks(live))).pending.tolist() == [
        True, False, False, False]


# -- steps ---------------------------------------------------------------------------------------


def test_union_len_and_bottleneck():
    assert steps._union_len([(5, 10), (0, 3), (8, 12), (20, 20), (2, 4)]) == 4 + 7
    assert steps.bottleneck(10, 50, 50) == "storage" and steps.bottleneck(60, 50, 50) == "scheduler"
    assert steps.bottleneck(10, 0, 0) == "scheduler" and steps.bottleneck(0, 0, 0) == "compute"
    assert steps.bottleneck(0, 10, 20, resumed=True) == "recompute"


def test_step_aggregates_and_table(ctx):
    ch, tr, kio, ev, pr = placed(ctx)
    agg = steps.step_aggregates(ctx, tr, kio)
    # S1's execute window [1100, 2000] = 900: loads [1200, 1400] and the connector's issue part
    # [1150, 1450]: union 300, + 30 ns of layer waits = 330; compute 570
    assert agg.sched_ns.tolist() == [100, 100, 100] and agg.exec_ns.tolist() == [900, 1400, 900]
    assert agg.storage_wait.tolist() == [330, 0, 0] and agg.compute.tolist() == [570, 1400, 900]
    assert {k: v.tolist() for k, v in agg.transfers.items()} == {
        "load_count": [2, 0, 0], "load_bytes": [8192, 0, 0], "store_count": [0, 0, 1], "store_bytes": [0, 0, 4096]}
    t = steps.steps_table(ctx, agg, ch, ev, pr, overlap.overlaps(ctx))
    rows = t.to_pylist()
    assert [(r["step"], r["chunks"], r["evicted_blocks"], r["preemptions"], r["overlapping_steps"], r["bottleneck"])
            for r in rows] == [(1, 2, 2, 0, 1, "compute"), (2, 1, 0, 0, 1, "compute"), (3, 1, 0, 1, 0, "compute")]
    assert [(r["shared_file_bytes"], r["shared_block_bytes"], r["nic_deltas"]) for r in rows] == [
        (512, 0, ""), (0, 0, ""), (300, 8192, "")]


# -- chunks table --------------------------------------------------------------------------------


def test_chunk_sums_rows_and_table(ctx):
    ch, tr, kio, ev, pr = placed(ctx)
    sums = chunk_table.chunk_sums(ch, tr, kio, ev, pr)
    assert {k: v.tolist() for k, v in sums.items() if v.any()} == {
        "evicted_blocks": [1, 0, 0, 0, 1], "preempted_others": [0, 0, 0, 1, 0], "load_count": [1, 0, 0, 0, 0],
        "load_blocks": [2, 0, 0, 0, 0], "load_bytes": [8192, 0, 0, 0, 0], "load_ns": [200, 0, 0, 0, 0],
        "file_read_bytes": [4096, 0, 0, 0, 0],            # file 1 is in the unnamed record: no chunk
        "block_read_bytes": [4096 + (2 << 20), 0, 0, 0, 0]}
    agg = steps.step_aggregates(ctx, tr, kio)
    ov = overlap.overlaps(ctx)
    nv = nvme.step_nvme(ctx, nvme.nvme_commands(ctx, tr), ov, ch)
    rows = chunk_table.chunk_rows(ctx, ch, requests.trace_ids(ctx), agg, ov, nv)
    # only an admission's first chunk has its cache hits; the shared 512 bytes of S1 split 60:40
    assert rows["cached_tokens"] == [48, 0, 0, 5, 0] and rows["hit_blocks"] == [1, 0, 0, 1, 0]
    assert rows["shared_file_bytes"] == [int(512 * 60 / 100), int(512 * 40 / 100), 0, 300, 0]
    assert rows["storage_wait_ns"] == [330, 330, 0, 0, 0]       # every chunk of S1 waits for its storage
    assert rows["bottleneck"] == ["compute", "compute", "compute", "recompute", "unknown"]  # D: no step record
    assert rows["t_start_ns"] == [1000, 1000, 1500, 4000, 0]
    tid = ids.trace_of("r", A, TP)[0]
    assert rows["trace_id"][0] == tid.hex() and rows["span_id"][0] == ids.chunk_span(tid, A, 0, 1).hex()
    assert rows["parent_span_id"][2] == ids.request_span(tid, A).hex()
    t = chunk_table.chunks_table(ch, sums, rows)
    assert t.num_rows == 5 and t["token_end"].to_pylist() == [60, 40, 100, 15, 8]
    assert t.column_names[:3] == ["engine_pid", "step", "request"] and t.column_names[-1] == "parent_span_id"


# -- attributions --------------------------------------------------------------------------------


def test_attributions_say_how(ctx):
    ch, tr, kio, ev, pr = placed(ctx)
    ov = overlap.overlaps(ctx)
    t = attributions.attributions(ctx, ch, tr, kio, ev, pr, nvme.nvme_commands(ctx, tr), ov)
    got = [(r["source"], r["start_ns"], r["how"], r["step"], r["request"], r["chunk_index"], r["transfer_start_ns"],
            r["candidates"]) for r in t.to_pylist()]
    assert got == [
        ("block_io", 1260, "thread_time", 1, A, 0, 1200, 1),
        ("block_io", 1270, "thread_time", 1, A, 0, 1200, 1),
        ("block_io", 4500, "shared", 3, "", None, None, 1),
        ("file_io", 1250, "thread_time", 1, A, 0, 1200, 1),
        ("file_io", 1450, "thread_time", 1, "", None, 1150, 1),
        ("file_io", 1700, "shared", 1, "", None, None, 2),
        ("file_io", 4250, "thread_time", 3, "", None, 4200, 1),
        ("file_io", 6000, "none", None, "", None, None, 0),      # the socket read is not storage I/O
        ("io_uring", 4700, "shared", 3, "", None, None, 1),      # SEND is not
        ("kv_load", 1200, "exact_id", 1, A, 0, None, 1),
        ("kv_load", 1150, "shared", 1, "", None, None, 1),
        ("kv_store", 4200, "shared", 3, "", None, None, 1),
        ("evict", 1050, "exact_id", 1, A, 0, None, 1),
        ("evict", 1051, "shared", 1, "", None, None, 1),
        ("evict", 9000, "exact_id", None, D, 0, None, 0),   # D's chunk, in no known step
        ("preempt", 4050, "exact_id", 3, A, None, None, 1),
    ]
    assert t.schema == pa.schema(attributions.ATTR_TYPES.items())


def test_attributions_of_nvme_threads_and_overlaps():
    tables = run()
    tables["nvme_cmd"] = nvme_table()
    c = context.context(tables, "r")
    ch, tr, kio, ev, pr = placed(c)
    ov = overlap.overlaps(c)
    t = attributions.attributions(c, ch, tr, kio, ev, pr, nvme.nvme_commands(c, tr), ov)
    rows = [r for r in t.to_pylist() if r["source"] == "nvme_cmd"]
    assert [(r["how"], r["start_ns"], r["step"], r["request"], r["share"]) for r in rows] == [
        ("thread_time", 1260, 1, A, 1.0),
        ("time_overlap", 1260, 1, "", 1.0), ("time_overlap", 1800, 1, "", 0.5), ("time_overlap", 1800, 2, "", 1.0),
        ("time_overlap", 2500, 2, "", 1.0), ("time_overlap", 4400, 3, "", 1.0)]


# -- spans ---------------------------------------------------------------------------------------


def test_spans_transfers_and_their_io_groups():
    tables = run()
    tables["nvme_cmd"] = nvme_table()
    c = context.context(tables, "r")
    ch, tr, kio, _, _ = placed(c)
    trs, groups = spans.spans(c, ch, tr, kio, nvme.nvme_commands(c, tr))
    assert [(t["dir"], t["request"], t["how"], t["step"], t["chunk_index"], t["chunk_step"]) for t in trs] == [
        ("load", A, "exact_id", 1, 0, 1), ("load", "", "shared", 1, None, None), ("store", "", "shared", 3, None, None)]
    # block I/O of at least 1 MiB alone, smaller aggregated per transfer, device and direction
    got = [(g["kind"], g["transfer"], g["single"], g["count"], g["bytes"], g["start_ns"], g["end_ns"]) for g in groups]
    assert got == [("block_io", 0, False, 1, 4096, 1260, 1290), ("block_io", 0, True, 1, 2 << 20, 1270, 1295),
                   ("file_io", 0, False, 1, 4096, 1250, 1300), ("file_io", 1, False, 1, 1024, 1450, 1460),
                   ("file_io", 2, False, 1, 2048, 4250, 4260), ("nvme_cmd", 0, False, 1, 4096, 1260, 1280)]
    assert groups[1]["sector"] == 160 and groups[0]["device"] == "nvme0n1" and groups[2]["files"] == 1
    # with a lower threshold, both of A's block reads get their own span
    c2 = context.context(tables, "r", io_span_bytes=4096)
    assert [g["single"] for g in spans.kernel_io_groups(c2, kio, {0: 0, 1: 1, 2: 2}) if g["kind"] == "block_io"] == [
        True, True]


# -- the wiring ----------------------------------------------------------------------------------


def test_correlate_wires_the_stages():
    tables = run()
    tables["nvme_cmd"] = nvme_table()
    res = core.correlate(tables, "r", final_before=2500)
    assert res.steps["step"].to_pylist() == [1] and res.chunks.num_rows == 3   # S1's two chunks and D's
    assert {k: v.tolist() for k, v in res.done.items()} == {
        "step": [True, False, False], "admit": [True, True, False], "finish": [True, False],
        "chunk": [True, True, False, False, True], "evict": [True, True, False], "preempt": [False],
        "kv_load": [True, True], "kv_store": [False],
        "block_io": [True, True, False], "file_io": [True, True, True, True, False, False],
        "io_uring": [False, False], "nvme_cmd": [True, True, False, False], "kv_alloc": [], "kv_done": []}
    assert res.steps["nic_deltas"].to_pylist() == [""] and res.steps["nvme_commands"].to_pylist() == [2.0]
    assert [g["step"] for g in res.nvme_groups] == [1, 1]


def test_a_steps_storage_wait_is_its_slowest_ranks():
    """Tensor-parallel ranks run a step in lock step: the step waits for the slowest rank's loads
    and layer waits, not for the union of every rank's loads plus every rank's waits."""
    from kvtrace.correlate.stages.steps import _critical_wait

    ranks = {101: [[(0, 10), (5, 15)], 3],     # union 15 + 3 waited in layers = 18
             102: [[(2, 8)], 2],               # 6 + 2 = 8
             103: [[(90, 120)], 0]}            # clipped to the step's end (100): 10
    assert _critical_wait(ranks, 0, 100) == 18
    assert _critical_wait({101: [[(0, 10)], 0]}, 4, 100) == 6        # one rank: its union inside the step
