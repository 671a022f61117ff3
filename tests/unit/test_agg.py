"""The aggregation maps and the sampling controller without the kernel (kvtrace.capture.agg):
rows are exact per-flush deltas of the maps, keyed and named as the raw tables are; the
controller follows the kernel's raises, says the switch once, and lowers again only after
losses stop (straight to every-event once a burst is over, one step while it goes on; the
wait doubles when a lowering brings losses back).  The rules the BPF side applies to a
single event are checked against the raw decoders' own definitions.  No root."""
from __future__ import annotations

import types

import numpy as np
import pytest

from kvtrace.capture import agg, blockio, fileio, iouring
from kvtrace.capture.events import KIND_BLOCK, KIND_FILEIO, KIND_URING, NKINDS, DecodeContext, weights
from kvtrace.errors import UsageError
from tests.unit.test_fabric_session import FakeMap, K

NS = types.SimpleNamespace


class PerCpu(FakeMap):
    """A per-CPU array: getvalue gives one value per CPU."""

    def getvalue(self, k):
        return self.get(getattr(k, "value", k), [0, 0])


def cfg_leaf(**kw):
    return NS(**{"shift": 0, "auto_raise": 0, "last_raise": 0, "drained": 0, "raises": 0, **kw})


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def maps():
    cfg = FakeMap()
    for k in range(NKINDS):
        cfg[k] = cfg_leaf()
    return {"agg_stats": FakeMap(), "agg_hist": FakeMap(), "agg_drops": FakeMap(), "sample_cfg": cfg,
            "lost": PerCpu(), "lost_weight": PerCpu()}


def val(count=0, bytes=0, errors=0, latency_ns=0, sum2=0, sum3=0):
    return NS(count=count, bytes=bytes, errors=errors, latency_ns=latency_ns, sum2=sum2, sum3=sum3)


def test_rows_are_exact_deltas_named_like_the_raw_tables():
    t = maps()
    ctx = DecodeContext(dev_names={(7 << 20) | 3: "loop3"})
    side = agg.AggMaps(t, [KIND_BLOCK, KIND_FILEIO, KIND_URING], ctx, mode="off")
    bkey = K(kind=KIND_BLOCK, tgid=42, dev=(7 << 20) | 3, op=0, slot=0)
    fkey = K(kind=KIND_FILEIO, tgid=42, dev=0, op=fileio.SYSCALLS.index("pread64"), slot=0)
    ukey = K(kind=KIND_URING, tgid=42, dev=0, op=iouring.OPCODES.index("READ"), slot=0)
    t["agg_stats"][bkey] = val(48, 48 * 131072, 0, 4_800_000, 100_000, 4_700_000)
    t["agg_stats"][fkey] = val(10, 640, 1, 50_000, 704)
    t["agg_stats"][ukey] = val(32, 32 * 131072, 0, 3_200_000)
    t["agg_hist"][K(kind=KIND_BLOCK, tgid=42, dev=(7 << 20) | 3, op=0, slot=17)] = 48
    t["agg_hist"][K(kind=KIND_FILEIO, tgid=42, dev=0, op=1, slot=12)] = 10
    out = side.drain()
    (b,) = out["block_agg"].to_pylist()
    assert (b["pid"], b["dev_major"], b["dev_minor"], b["disk"], b["op"]) == (42, 7, 3, "loop3", "R")
    assert (b["requests"], b["bytes"], b["latency_sum_ns"], b["queue_sum_ns"], b["device_sum_ns"]) == \
        (48, 48 * 131072, 4_800_000, 100_000, 4_700_000)
    (f,) = out["file_agg"].to_pylist()
    assert (f["syscall"], f["calls"], f["bytes"], f["errors"], f["requested"]) == ("pread64", 10, 640, 1, 704)
    (u,) = out["uring_agg"].to_pylist()
    assert (u["opcode"], u["op"], u["completions"], u["bytes"]) == (22, "READ", 32, 32 * 131072)
    (h,) = out["block_agg_hist"].to_pylist()
    assert (h["slot"], h["lo_ns"], h["hi_ns"], h["count"]) == (17, 65536, 131071, 48)
    assert out["file_agg_hist"].to_pylist()[0]["syscall"] == "pread64"
    assert "uring_agg_hist" not in out
    # the next flush: only what moved, by how much
    t["agg_stats"][fkey] = val(15, 960, 1, 80_000, 1024)
    t["agg_hist"][K(kind=KIND_FILEIO, tgid=42, dev=0, op=1, slot=12)] = 14
    t["agg_hist"][K(kind=KIND_FILEIO, tgid=42, dev=0, op=1, slot=20)] = 1
    out = side.drain()
    assert set(out) == {"file_agg", "file_agg_hist"}
    (f,) = out["file_agg"].to_pylist()
    assert (f["calls"], f["bytes"], f["errors"], f["requested"], f["latency_sum_ns"]) == (5, 320, 0, 320, 30_000)
    assert sorted((h["slot"], h["count"]) for h in out["file_agg_hist"].to_pylist()) == [(12, 4), (20, 1)]
    assert side.drain() == {}
    # a full map is said per raw table in the run row
    t["agg_drops"][K(value=KIND_FILEIO)] = 2
    t["agg_drops"][K(value=NKINDS + KIND_FILEIO)] = 1
    side.drain()
    assert side.sampling()["file_io"]["agg_map_full"] == 3 and side.sampling()["block_io"]["agg_map_full"] == 0


def test_modes_set_the_kernel_side():
    t = maps()
    agg.AggMaps(t, [KIND_FILEIO, KIND_BLOCK], mode="auto")
    assert (t["sample_cfg"][KIND_FILEIO].shift, t["sample_cfg"][KIND_FILEIO].auto_raise, t["sample_cfg"][KIND_FILEIO].drained) == (0, 1, 1)
    assert t["sample_cfg"][KIND_URING].auto_raise == 0          # not attached: untouched
    t = maps()
    side = agg.AggMaps(t, [KIND_FILEIO], mode=16)
    assert (t["sample_cfg"][KIND_FILEIO].shift, t["sample_cfg"][KIND_FILEIO].auto_raise) == (4, 0)
    assert side.sampling()["file_io"]["n"] == 16
    t = maps()
    agg.AggMaps(t, [KIND_FILEIO], mode="off")
    assert (t["sample_cfg"][KIND_FILEIO].shift, t["sample_cfg"][KIND_FILEIO].auto_raise) == (0, 0)
    assert [agg.parse_mode(x) for x in ("auto", "OFF", "1", "64")] == ["auto", "off", 1, 64]
    for bad in ("3", "0", "-4", "many", str(1 << 16)):
        with pytest.raises(UsageError):
            agg.parse_mode(bad)


def test_controller_switches_on_says_so_and_backs_off():
    t, clock, said = maps(), Clock(), []
    side = agg.AggMaps(t, [KIND_FILEIO], mode="auto", echo=said.append, clock=clock)
    key = K(kind=KIND_FILEIO, tgid=1, dev=0, op=1, slot=0)
    total = 0

    def flush(events: int, lost: int | None = None, kernel_shift: int | None = None):
        nonlocal total
        clock.t += 1.0
        total += events
        t["agg_stats"][key] = val(total)
        if lost is not None:
            t["lost"][KIND_FILEIO] = [lost, 0]
        if kernel_shift is not None:
            t["sample_cfg"][KIND_FILEIO].shift = kernel_shift
        side.drain()
        return t["sample_cfg"][KIND_FILEIO].shift

    assert flush(10_000) == 0 and said == []      # keeps up: the reader's safe rate is 10k/s
    # a burst of 300k/s: the kernel raised to 1 in 32 on its own; one line says so
    assert flush(300_000, lost=5000, kernel_shift=5) == 5
    assert len(said) == 1 and "now sampled 1 in 32" in said[0] and "file_agg stays exact" in said[0]
    # still losing: no lowering
    assert flush(300_000, lost=6000) == 5
    # quiet, burst going on: one step down once hold (2 s) has passed, then one per flush
    assert flush(300_000) == 5
    assert flush(300_000) == 4
    assert flush(300_000) == 3
    # that lowering brought losses back: the kernel raises, the next wait is twice as long
    assert flush(300_000, lost=6100, kernel_shift=4) == 4
    assert side.state[KIND_FILEIO].hold == 4.0
    assert [flush(300_000) for _ in range(4)] == [4, 4, 4, 3]
    # the burst is over: the true rate fits the safe rate, so straight back to every event
    assert flush(500) == 0
    assert len(said) == 2 and "every raw event kept" in said[1] and "at most 1 in 32" in said[1]
    rec = side.sampling()["file_io"]
    assert rec["n"] == 1 and rec["max_n"] == 32 and rec["raises"] == 6 and rec["lowers"] == 4
    assert [c[1] for c in rec["changes"]] == [32, 16, 8, 16, 8, 1]
    assert rec["sampled_s"] > 0


def test_a_raise_between_read_and_write_wins():
    t, clock = maps(), Clock()
    side = agg.AggMaps(t, [KIND_FILEIO], mode="auto", clock=clock)
    t["sample_cfg"][KIND_FILEIO].shift = 3
    side.control({KIND_FILEIO: 0}, 1.0)
    clock.t += 10
    real = t["sample_cfg"].__class__.__getitem__
    calls = []

    class Racy(FakeMap):
        def __getitem__(self, k):
            leaf = real(self, k)
            calls.append(1)
            if len(calls) == 2:          # the kernel raises between the controller's read and write
                leaf.shift = 4
            return leaf

    racy = Racy(t["sample_cfg"])
    side.t["sample_cfg"] = racy
    side.control({KIND_FILEIO: 0}, 1.0)
    assert racy[KIND_FILEIO].shift == 4


def test_bpf_rules_match_the_raw_decoders():
    """What the kernel adds to the maps for one event, written again from kvtrace.h and the
    probes, equals what the raw decoder makes of the same event."""
    ctx = DecodeContext()
    # block: op class from rwbs as op_of, bytes only without error, queue/device split as the decoder
    for rwbs, op in ((b"RS", 0), (b"WFS", 1), (b"FWS", 3), (b"D", 2), (b"N", 4), (b"RA", 0)):
        a = np.zeros(1, blockio.DTYPE)
        a["rwbs"], a["ts_start"], a["ts_issue"], a["ts"], a["bytes"] = rwbs, 1000, 1500, 9000, 4096
        row = blockio.decode([a.tobytes()], ctx).to_pylist()[0]
        assert agg.BLOCK_OPS[op] == row["op"]
        assert (1500 - 1000, 9000 - 1500) == (row["queue_ns"], row["device_ns"])
    # io_uring: bytes counted for data opcodes only (the BPF list is DATA_OPS)
    data = [i for i, n in enumerate(iouring.OPCODES) if n in iouring.DATA_OPS]
    assert data == [1, 2, 4, 5, 22, 23, 49]
    # weights: an old record (padding 0) stands for one event
    assert weights(np.array([0, 1, 8], np.uint16)).tolist() == [1, 1, 8]


def test_bad_sampling_is_a_one_line_usage_error(tmp_path):
    from tests.conftest import run_kvtrace

    p = run_kvtrace("attach", "--sampling", "3", "--out", str(tmp_path / "ds"), "--", "true")
    assert p.returncode == 2 and "--sampling 3" in p.stderr and "power of two" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_keys_of_exited_processes_are_swept_once_read():
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    t = maps()
    side = agg.AggMaps(t, [KIND_FILEIO], mode="off")
    dead = K(kind=KIND_FILEIO, tgid=gone.pid, dev=0, op=1, slot=0)
    alive = K(kind=KIND_FILEIO, tgid=1, dev=0, op=1, slot=0)
    t["agg_stats"][dead] = val(5, 50)
    t["agg_stats"][alive] = val(7, 70)
    t["agg_hist"][K(kind=KIND_FILEIO, tgid=gone.pid, dev=0, op=1, slot=9)] = 5
    rows = [side.drain() for _ in range(agg.SWEEP_EVERY)]
    assert sum(r["calls"] for d in rows if "file_agg" in d for r in d["file_agg"].to_pylist()) == 12  # counted once
    assert dead not in t["agg_stats"] and alive in t["agg_stats"] and len(t["agg_hist"]) == 0
    assert side.stats()["keys_swept"] == 2
    # the pid comes back (reused): counted from zero, nothing counted twice
    t["agg_stats"][dead] = val(3, 30)
    (r,) = [x for x in side.drain()["file_agg"].to_pylist() if x["pid"] == gone.pid]
    assert (r["calls"], r["bytes"]) == (3, 30)


def test_block_requests_open_at_the_stop_on_an_idle_disk_ended_untraced(tmp_path):
    """At a clean stop: a request the probe holds as issued on a disk with nothing in flight
    ended without its completion traced (the kernel skipped the probe): a block_io row without
    error or latency in the last flush.  A request never issued, and one on a busy disk, stay."""
    for disk, text in (("loop3", "0 0\n"), ("loop4", "2 0\n")):
        (tmp_path / "sys" / "block" / disk).mkdir(parents=True)
        (tmp_path / "sys" / "block" / disk / "inflight").write_text(text)
    t = maps()
    start = t["block_start"] = FakeMap()
    loop3, loop4 = (7 << 20) | 3, (7 << 20) | 4

    def rec(ts_issue, nbytes):
        return NS(ts_start=1_000, ts_issue=ts_issue, tgid=42, tid=43, bytes=nbytes, from_dev=0, rwbs=b"RS",
                  comm=b"kvreader")

    start[K(dev=loop3, sector=2048)] = rec(1_500, 131072)
    start[K(dev=loop3, sector=4096)] = rec(0, 4096)           # queued, never issued: left alone
    start[K(dev=loop4, sector=8)] = rec(1_700, 4096)          # a busy disk: left open
    ctx = DecodeContext(dev_names={loop3: "loop3", loop4: "loop4"})
    side = agg.AggMaps(t, [KIND_BLOCK], ctx, mode="off", root=str(tmp_path))
    side.close()
    (row,) = side.drain()["block_io"].to_pylist()
    assert (row["disk"], row["sector"], row["bytes"], row["op"], row["pid"], row["tid"], row["comm"]) == (
        "loop3", 2048, 131072, "R", 42, 43, "kvreader")
    assert (row["start_ns"], row["issue_ns"], row["queue_ns"]) == (1_000, 1_500, 500)
    assert (row["error"], row["device_ns"], row["latency_ns"], row["weight"]) == (None, None, None, 1)
    assert sorted(k.sector for k in start) == [8, 4096]
    assert (side.stats()["block_unseen_at_stop"], side.stats()["block_open_at_stop"]) == (1, 1)
    assert "block_io" not in side.drain()
