"""NIC/RDMA counter readers against recorded sysfs trees (mlx5 and rxe layouts, tests/data/sysfs):
units (4-byte words), 32-bit wraps, 64-bit resets, saturation, garbage, unreadable files,
vanished counters and devices; the delta rules against their scalar definition; what a
poll reads (its cost is bench/nic_poll.py's).  No root."""
from __future__ import annotations

import errno
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.fabric import counters
from kvtrace.fabric.counters import Batch, Deltas, Spec, step
from tests.sysfs_tree import materialize, mlx5_four_ports, steps


def poll_tree(tmp_path, tree, **kw):
    """Poll a tree once per recorded step."""
    materialize(tree, tmp_path, 0)
    p = counters.NicPoller(interval=0.1, root=str(tmp_path), **kw)
    for i in range(steps(tree)):
        if i:
            materialize(tree, tmp_path, i)
        p.poll_once(full=(i == 0))
    rows = p.drain()[counters.TABLE].to_pylist()
    return p, rows


def series(rows, device, port, name):
    return [(r["raw"], r["value"], r["delta"], r["status"]) for r in rows
            if (r["device"], r["port"], r["name"]) == (device, port, name)]


def test_mlx5_units_wraps_resets_saturation_garbage_and_unplug(tmp_path, monkeypatch):
    real_pread = os.pread
    eio = set()

    def pread(fd, n, off):
        if fd in eio:
            raise OSError(errno.EIO, "Input/output error")
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)
    materialize("rdma-mlx5.tree", tmp_path, 0)
    p = counters.NicPoller(interval=0.1, root=str(tmp_path))
    for i in range(steps("rdma-mlx5.tree")):
        if i:
            materialize("rdma-mlx5.tree", tmp_path, i)
        eio.clear()
        if i == 1:  # the firmware query fails for one counter (mlx5 returns EIO while resetting)
            eio.add(dict(zip(p.rdma.keys, p.rdma.fds))[("ib_hw_counters", "mlx5_0", 1, "out_of_buffer")])
        if i == 3:  # mlx5_1 is unplugged
            os.unlink(tmp_path / "sys/class/infiniband/mlx5_1")
        p.poll_once(full=(i == 0))
    rows = p.drain()[counters.TABLE].to_pylist()

    # port_xmit_data counts 4-byte words: 250000 words per poll = 1,000,000 bytes
    assert series(rows, "mlx5_0", 1, "port_xmit_data") == [
        (1000000, 4000000, None, "first"), (1250000, 5000000, 1000000, "ok"),
        (1500000, 6000000, 1000000, "ok"), (1750000, 7000000, 1000000, "ok")]
    assert {r["unit"] for r in rows if r["name"] == "port_xmit_data"} == {"bytes"}
    # 32-bit Q counter across its wrap: 4294967000 -> 4294967290 -> 200 -> 500
    assert series(rows, "mlx5_0", 1, "out_of_sequence") == [
        (4294967000, 4294967000, None, "first"), (4294967290, 4294967290, 290, "ok"),
        (200, 200, 206, "wrap"), (500, 500, 300, "ok")]
    # 64-bit congestion counter that went down: a reset, no delta, the new value is the baseline
    assert series(rows, "mlx5_0", 1, "rp_cnp_handled") == [
        (10, 10, None, "first"), (12, 12, 2, "ok"), (3, 3, None, "reset"), (5, 5, 2, "ok")]
    # garbage in between: no row value, and the next delta is from the last good value
    assert series(rows, "mlx5_0", 1, "local_ack_timeout_err") == [
        (7, 7, None, "first"), (None, None, None, "garbage"), (9, 9, 2, "ok")]
    # an unreadable file (EIO): recorded, baseline kept, and it reads again later (delta 0: quiet)
    assert series(rows, "mlx5_0", 1, "out_of_buffer") == [(0, 0, None, "first"), (None, None, None, "error")]
    # a 16-bit PMA error counter stops at 65535 (saturated, reported when it gets there)
    assert series(rows, "mlx5_0", 1, "symbol_error") == [(65534, 65534, None, "first"), (65535, 65535, 1, "saturated")]
    # a counter that disappears, and a whole device unplugged before poll 3
    assert series(rows, "mlx5_0", 1, "duplicate_request")[-1][3] == "vanished"
    gone = [r for r in rows if r["device"] == "mlx5_1" and r["status"] == "vanished"]
    had = [r for r in rows if r["device"] == "mlx5_1" and r["status"] == "first"]
    assert len(gone) == len(had) == 52
    assert all(r["ts_ns"] == max(x["ts_ns"] for x in rows) for r in gone)
    # the congestion and retransmission counters a KV fabric needs are there, with units
    names = {r["name"] for r in rows if r["device"] == "mlx5_0"}
    assert {"np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets", "out_of_sequence",
            "local_ack_timeout_err", "packet_seq_err", "roce_adp_retrans"} <= names
    assert "lifespan" not in names  # a setting, not a counter
    # device-level hw_counters (port 0) are read too; netdev is attached to port rows
    assert any(r["port"] == 0 and r["source"] == "ib_hw_counters" for r in rows)
    assert {r["netdev"] for r in rows if r["device"] == "mlx5_0" and r["port"] == 1} == {"eth2"}
    # no delta is ever negative (the column is unsigned: a negative would not even be written)
    assert all(r["delta"] is None or r["delta"] >= 0 for r in rows)
    s = p.stats()
    assert (s["status_wrap"], s["status_reset"], s["status_garbage"], s["status_error"]) == (1, 1, 1, 1)
    assert s["rdma_devices"] == ["mlx5_0"]


def test_rxe_layout_hw_counters_only(tmp_path):
    p, rows = poll_tree(tmp_path, "rdma-rxe.tree")
    assert {r["source"] for r in rows} == {"ib_hw_counters"}  # rxe has no PMA: no counters/
    assert series(rows, "rxe0", 1, "sent_pkts") == [(100, 100, None, "first"), (350, 350, 250, "ok"), (600, 600, 250, "ok")]
    assert series(rows, "rxe0", 1, "rcvd_seq_err")[-1] == (2, 2, 2, "ok")
    assert {r["unit"] for r in rows if r["name"] in ("sent_pkts", "rcvd_pkts")} == {"packets"}
    assert {r["netdev"] for r in rows} == {"eth1"}
    info = counters.ib_devices(str(tmp_path))
    assert info["rxe0"]["driver"] == "rxe"
    assert info["rxe0"]["ports"][1]["hw_counters"] == 15 and info["rxe0"]["ports"][1]["counters"] == 0
    assert counters.rdma_netdevs(str(tmp_path)) == ["eth1"]


def test_quiet_counters_write_rows_only_on_full_snapshots(tmp_path):
    materialize("rdma-rxe.tree", tmp_path, 2)
    p = counters.NicPoller(interval=0.1, root=str(tmp_path))
    p.poll_once(full=True)
    first = len(p.drain()[counters.TABLE])
    for _ in range(5):
        p.poll_once(full=False)
    assert p.drain() == {}  # nothing moved
    p.poll_once(full=True)
    assert len(p.drain()[counters.TABLE]) == first == 15


def test_a_device_that_appears_later_gets_a_baseline_not_a_delta(tmp_path):
    materialize("rdma-rxe.tree", tmp_path, 0)
    link = tmp_path / "sys/class/infiniband/rxe0"
    target = os.readlink(link)
    link.unlink()
    p = counters.NicPoller(interval=0.1, root=str(tmp_path))
    p.poll_once(full=True)
    assert p.drain() == {}
    os.symlink(target, link)
    p.rdma.polls = 0  # the next poll rediscovers (as it does every rescan polls)
    p.poll_once(full=False)
    rows = p.drain()[counters.TABLE].to_pylist()
    assert {r["status"] for r in rows} == {"first"} and len(rows) == 15


def test_a_poll_preads_each_counter_once_and_writes_rows_for_what_moved(tmp_path, monkeypatch):
    """Between rescans a poll is one pread per counter file, on the descriptors opened at
    discovery, and rows only for the counters that moved.  (Its cost: bench/nic_poll.py.)"""
    mlx5_four_ports(tmp_path)
    ib = tmp_path / "sys/class/infiniband"
    files = [f for f in (*ib.glob("*/ports/*/counters/*"), *ib.glob("*/ports/*/hw_counters/*"), *ib.glob("*/hw_counters/*"))
             if f.name not in counters.HW_SKIP]
    p = counters.NicPoller(interval=0.1, root=str(tmp_path))
    p.poll_once(full=True)
    assert len(p.drain()[counters.TABLE]) == len(files) == len(p.rdma.fds) == 217
    preads, opens = Counter(), []
    real_pread, real_open = os.pread, os.open
    monkeypatch.setattr(os, "pread", lambda fd, n, off: preads.update([fd]) or real_pread(fd, n, off))
    monkeypatch.setattr(os, "open", lambda path, *a, **kw: opens.append(path) or real_open(path, *a, **kw))
    for _ in range(3):
        p.poll_once(full=False)
    assert p.drain() == {}  # nothing moved
    assert opens == [] and sorted(preads) == sorted(p.rdma.fds) and set(preads.values()) == {3}
    (ib / "mlx5_2/ports/1/hw_counters/out_of_sequence").write_text("4294967100\n")  # in place, as sysfs
    p.poll_once(full=False)
    rows = p.drain()[counters.TABLE].to_pylist()
    assert [(r["device"], r["port"], r["name"], r["delta"], r["status"]) for r in rows] == [
        ("mlx5_2", 1, "out_of_sequence", 100, "ok")]
    assert opens == [] and set(preads.values()) == {4}


@pytest.mark.parametrize("spec,prev,cur,want", [
    (Spec(32, wraps=True), 4294967290, 5, (11, "wrap")),
    (Spec(64), 10, 3, (None, "reset")),
    (Spec(16, saturating=True), 65000, 65535, (535, "saturated")),
    (Spec(16, saturating=True), 65535, 0, (None, "reset")),   # cleared
    (Spec(0), 4294967000, 100, (396, "wrap")),                # unknown width: a plausible 32-bit wrap
    (Spec(0), 4294967000, 3000000000, (None, "reset")),       # implausible as a wrap
    (Spec(64), None, 7, (None, "first")),
    (Spec(64), 7, None, (None, "garbage")),
])
def test_step_rules(spec, prev, cur, want):
    assert step(prev, cur, spec) == want


SPECS = [Spec(64), Spec(32, wraps=True), Spec(16, saturating=True), Spec(0), Spec(32, 4, "bytes", saturating=True)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(SPECS) - 1),
                          st.lists(st.one_of(st.none(), st.integers(0, (1 << 64) - 1), st.integers(0, 70000),
                                             st.integers((1 << 32) - 300, (1 << 32) + 300)), min_size=1, max_size=8)),
                min_size=1, max_size=6))
def test_batch_deltas_equal_the_scalar_rule(counters_spec):
    """The numpy path (Deltas) gives exactly what step() says, for any sequence of reads."""
    keys = [("t", "dev", 0, f"c{i}") for i in range(len(counters_spec))]
    specs = [SPECS[s] for s, _ in counters_spec]
    d = Deltas()
    prev = [None] * len(keys)
    nsteps = max(len(v) for _, v in counters_spec)
    for t in range(nsteps):
        raws = [v[min(t, len(v) - 1)] for _, v in counters_spec]
        vals = [r if r is not None and r < (1 << 64) else 0 for r in raws]
        ok = [r is not None for r in raws]
        b = Batch(keys, specs, [""] * len(keys), np.array(vals, dtype=np.uint64), np.array(ok, dtype=bool),
                  {i: "garbage" for i, o in enumerate(ok) if not o}, ("t",))
        cols = {c: [] for c in counters.COLS}
        d.rows([b], 1000 * (t + 1), True, cols)
        got = {cols["name"][i]: (cols["delta"][i], cols["status"][i]) for i in range(len(cols["name"]))}
        for i, k in enumerate(keys):
            dd, status = step(prev[i], raws[i], specs[i])
            want = (dd * specs[i].scale if dd is not None else None, status)
            assert got[k[3]] == want, (t, k, prev[i], raws[i], specs[i])
            assert want[0] is None or want[0] >= 0
            if status != "garbage":
                prev[i] = raws[i]
