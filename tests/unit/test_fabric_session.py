"""The fabric side of a capture without the kernel: kernel-map rows (exact per-flush deltas,
histogram buckets, per-interval SQ peaks, CQ polling), the topology watcher (snapshot,
changes, what the nvme probe is told), and attach's options.  No root."""
from __future__ import annotations

import types

import click
from click.testing import CliRunner

from kvtrace.capture.events import DecodeContext
from kvtrace.attach import fabric as session
from kvtrace.capture.kstats import KernelMaps
from kvtrace.fabric.sysfs import kernel_dev
from tests.conftest import run_kvtrace
from tests.sysfs_tree import materialize

NS = types.SimpleNamespace


class K:
    """A hashable key with attributes, like a bcc map key."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __hash__(self):
        return hash(tuple(sorted(self.__dict__.items())))

    def __eq__(self, other):
        return self.__dict__ == other.__dict__


class FakeMap(dict):
    """Enough of a bcc table: items(), Key/Leaf constructors, item assignment."""

    Key = staticmethod(lambda **kw: tuple(sorted(kw.items())))
    Leaf = staticmethod(lambda **kw: NS(**kw))

    def items(self):
        return list(super().items())

    def __getitem__(self, k):
        return super().__getitem__(getattr(k, "value", k))

    def __setitem__(self, k, v):
        super().__setitem__(getattr(k, "value", k), v)


def qstat(**kw):
    base = dict(setups=0, completions=0, bytes=0, latency_ns=0, errors=0, retried=0, unmatched=0, unseen=0,
                sq_samples=0, sq_occ_sum=0, sq_occ_max=0, sq_epoch=0)
    base.update(kw)
    return NS(**base)


def test_kernel_maps_give_exact_deltas_per_flush():
    qs, hist, drops, cq, cfg = FakeMap(), FakeMap(), FakeMap(), FakeMap(), FakeMap()
    cfg[0] = NS(slow_ns=0, budget=1, mode=0, epoch=0, pad=0)
    k_read = K(ctrl_id=0, qid=2, opclass=0)
    k_sq = K(ctrl_id=2, qid=1, opclass=7)
    qs[k_read] = qstat(setups=10, completions=10, bytes=40960, latency_ns=1_000_000, errors=1)
    qs[k_sq] = qstat(sq_samples=4, sq_occ_sum=20, sq_occ_max=9, sq_epoch=0)
    hk = K(ctrl_id=0, qid=2, opclass=0, slot=17)
    hist[hk] = 10
    cq[K(value=42)] = NS(polls=5, completions=40, full_polls=1, wakeups=5, wakeup_lat_us=100, wakeup_lat_max_us=60,
                          interrupts=5, reschedules=0)
    ctx = DecodeContext()
    km = KernelMaps({"nvme_qstats": qs, "nvme_hist": hist, "nvme_drops": drops, "rdma_cq": cq}, ctx, cfg)
    out = km.drain()
    rows = {(r["ctrl_id"], r["qid"], r["opclass"]): r for r in out["nvme_queue"].to_pylist()}
    r = rows[(0, 2, "read")]
    assert (r["completions"], r["bytes"], r["errors"], r["latency_avg_ns"]) == (10, 40960, 1, 100_000.0)
    s = rows[(2, 1, "queue")]
    assert (s["sq_samples"], s["sq_occupancy_avg"], s["sq_occupancy_max"]) == (4, 5.0, 9)
    (h,) = out["nvme_queue_hist"].to_pylist()
    assert (h["slot"], h["lo_ns"], h["hi_ns"], h["count"]) == (17, 65536, 131071, 10)
    (c,) = out["rdma_cq"].to_pylist()
    assert (c["cq_id"], c["polls"], c["completions"], c["full_polls"], c["wakeup_latency_sum_us"]) == (42, 5, 40, 1, 100)
    assert cfg[0].epoch == 1          # the next interval's SQ peak starts afresh
    # second flush: only what changed; a queue whose counts did not move gives no row
    qs[k_read] = qstat(setups=13, completions=12, bytes=49152, latency_ns=1_300_000, errors=1, retried=1)
    qs[k_sq] = qstat(sq_samples=6, sq_occ_sum=26, sq_occ_max=2, sq_epoch=1)
    hist[hk] = 12
    hist[K(ctrl_id=0, qid=2, opclass=0, slot=20)] = 1
    out = km.drain()
    rows = {(r["ctrl_id"], r["qid"], r["opclass"]): r for r in out["nvme_queue"].to_pylist()}
    r = rows[(0, 2, "read")]
    assert (r["setups"], r["completions"], r["bytes"], r["errors"], r["retried"], r["latency_sum_ns"]) == (3, 2, 8192, 0, 1, 300_000)
    assert rows[(2, 1, "queue")]["sq_occupancy_max"] == 2
    assert sorted((h["slot"], h["count"]) for h in out["nvme_queue_hist"].to_pylist()) == [(17, 2), (20, 1)]
    assert "rdma_cq" not in out
    assert km.drain() == {}
    drops[K(value=1)] = 3
    km.drain()
    assert km.lost() == 3 and km.stats()["hist_map_full"] == 3


def test_topology_watcher_rows_bpf_maps_and_changes(tmp_path, monkeypatch):
    materialize("nvme.tree", tmp_path, 0)
    ns_map, qd_map = FakeMap(), FakeMap()
    ctx = DecodeContext()
    w = session.TopologyWatcher(ctx, {"nvme_ns": ns_map, "nvme_qdepth": qd_map}, interval=0.0, root=str(tmp_path))
    out = w.drain()
    assert len(out["nvme_ctrl"]) == 3 and len(out["nvme_ns"]) == 3 and len(out["nvme_hctx"]) == 6
    assert set(out["nvme_ctrl"].column("event").to_pylist()) == {"snapshot"}
    assert sorted(ctx.nvme_ctrls) == [0, 1, 2] and ctx.nvme_ctrls[0].transport == "tcp"
    leaf = ns_map[(("ctrl_id", 0), ("nsid", 1))]
    assert (leaf.dev1, leaf.dev2, leaf.lba_shift) == (0, kernel_dev(259, 0), 12)
    assert qd_map[2].value == 1024
    materialize("nvme.tree", tmp_path, 3)   # nvme0 reconnecting, its path inaccessible
    out = w.drain()
    assert sorted(out["nvme_ctrl"].to_pylist()[0][k] for k in ("event", "state")) == ["changed", "connecting"]
    assert [(r["disk"], r["ana_state"]) for r in out["nvme_ns"].to_pylist()] == [("nvme0c0n1", "inaccessible")]
    assert w.drain() == {} and w.stats()["changes"] == 2


def test_fabric_options_go_to_the_context_and_bad_ones_are_usage_errors():
    seen = {}

    @click.command()
    @click.option("--x", default=1)
    @session.options
    def cmd(x):
        seen["x"] = x
        seen["opts"] = session.current_options()

    r = CliRunner().invoke(cmd, ["--x", "2", "--nvme-tcp-port", "4420", "--nvme-tcp-port", "8009", "--nic", "eth2",
                                 "--nvme-events", "all", "--no-nic"])
    assert r.exit_code == 0, r.output
    o = seen["opts"]
    assert seen["x"] == 2 and o.nvme_tcp_ports == (4420, 8009) and o.nics == ("eth2",) and o.nvme_events == "all" and o.no_nic
    CliRunner().invoke(cmd, [])
    assert seen["opts"].nvme_tcp_ports == (4420,) and seen["opts"].nic_interval == 0.1
    p = run_kvtrace("attach", "--out", "/tmp/kvtrace-never", "--nvme-tcp-port", "70000", "--", "true")
    assert p.returncode == 2 and "--nvme-tcp-port 70000: not a TCP port" in p.stderr
    p = run_kvtrace("attach", "--out", "/tmp/kvtrace-never", "--nic-netns", "no-such-ns-kvtrace", "--", "true")
    assert p.returncode == 2 and "no such network namespace" in p.stderr


def test_start_without_bpf_still_watches_topology_and_counters(tmp_path):
    materialize("rdma-rxe.tree", tmp_path, 0)
    materialize("nvme.tree", tmp_path, 0)
    added, said = [], []
    pipe = NS(plan=NS(attached=["proc"]), ctx=DecodeContext(), add_sidecar=added.append)
    opts = session.Options(root=str(tmp_path), nic_interval=0.05)
    started = session.start(pipe, NS(), opts, echo=said.append)
    try:
        kinds = [type(s).__name__ for s in added]
        assert kinds == ["TopologyWatcher", "NicPoller"]
        assert "3 NVMe controllers (nvme0 tcp, nvme1 rdma, nvme2 pcie)" in said[-1]
        assert "NIC counters of rxe0 (eth1)" in said[-1]
    finally:
        for s in started.sidecars:
            if hasattr(s, "close"):
                s.close()


def _start(ts, cid, opcode=0x02, nlb=8, nbytes=32768, tid=70, xflags=0, nsid=1):
    return NS(ts=ts, slba=4096, nsid=nsid, nlb=nlb, bytes=nbytes, tgid=70, tid=tid, setup_tid=tid, cid=cid,
              opcode=opcode, fctype=0xFF, flags=0, issuer=1, xflags=xflags, pad=0, comm=b"kvreader")


def _disks(root, **inflight):
    for disk, text in inflight.items():
        (root / "sys" / "block" / disk).mkdir(parents=True)
        (root / "sys" / "block" / disk / "inflight").write_text(text)


def _ctrl(i, *disks):
    return NS(namespaces=[NS(disk=d, head=h, nsid=1, lba_bytes=4096, hctx=[]) for d, h in disks], transport="tcp",
              target="10.0.0.1:4420")


def test_commands_open_at_the_stop_on_an_idle_controller_ended_untraced(tmp_path):
    """At a clean stop: what the probe still holds as set up on a controller whose disks have
    nothing in flight ended without its completion traced: counted (completions, unseen,
    bytes) in the last flush and written as nvme_cmd rows without latency; admin commands and
    a busy controller's are left open and said."""
    _disks(tmp_path, nvme0c0n1="       0        0\n", nvme0n1="0 0\n", nvme1n1="       1        0\n")
    start, qs = FakeMap(), FakeMap()
    start[K(ctrl_id=0, qid=2, tag=24)] = _start(1_000, (1 << 12) | 24)
    start[K(ctrl_id=0, qid=2, tag=25)] = _start(1_100, (1 << 12) | 25, nlb=5, nbytes=2560, xflags=1)  # LBA size learnt late
    start[K(ctrl_id=0, qid=1, tag=3)] = _start(1_200, 3, opcode=0x01, nbytes=4096, nlb=1)
    start[K(ctrl_id=0, qid=0, tag=9)] = _start(1_300, 9, opcode=0x06, nbytes=0, nlb=0)    # admin: no disk to ask
    qs[K(ctrl_id=0, qid=2, opclass=0)] = qstat(setups=5, completions=3, bytes=3 * 32768, latency_ns=300)
    qs[K(ctrl_id=0, qid=1, opclass=1)] = qstat(setups=1)
    ctx = DecodeContext()
    ctx.nvme_ctrls = {0: _ctrl(0, ("nvme0c0n1", "nvme0n1")), 1: _ctrl(1, ("nvme1n1", "nvme1n1"))}
    km = KernelMaps({"nvme_qstats": qs, "nvme_hist": FakeMap(), "nvme_start": start}, ctx, root=str(tmp_path))
    km.close()
    out = km.drain()
    rows = {(r["qid"], r["opclass"]): r for r in out["nvme_queue"].to_pylist()}
    r = rows[(2, "read")]
    assert (r["setups"], r["completions"], r["unseen"], r["bytes"], r["latency_avg_ns"]) == (
        5, 5, 2, 3 * 32768 + 32768 + 5 * 4096, 100.0)   # the average is over the 3 timed completions
    w = rows[(1, "write")]
    assert (w["setups"], w["completions"], w["unseen"], w["bytes"], w["latency_avg_ns"]) == (1, 1, 1, 4096, None)
    cmd = sorted(out["nvme_cmd"].to_pylist(), key=lambda x: x["setup_ns"])
    assert [(c["qid"], c["cid"], c["setup_ns"], c["bytes"], c["latency_ns"], c["status"], c["comm"]) for c in cmd] == [
        (2, (1 << 12) | 24, 1_000, 32768, None, None, "kvreader"),
        (2, (1 << 12) | 25, 1_100, 5 * 4096, None, None, "kvreader"),
        (1, 3, 1_200, 4096, None, None, "kvreader")]
    assert list(start) == [K(ctrl_id=0, qid=0, tag=9)]        # settled ones removed, the admin one kept
    st = km.stats()
    assert (st["unseen_at_stop"], st["open_at_stop"], st["unseen"]) == (3, 0, 3)
    assert km.drain().get("nvme_cmd") is None                 # written once


def test_a_busy_controllers_commands_get_time_to_complete_then_stay_open(tmp_path):
    from kvtrace.capture import settle

    _disks(tmp_path, nvme1n1="1 0\n")
    start = FakeMap()
    start[K(ctrl_id=1, qid=1, tag=4)] = _start(5_000, 4)
    start[K(ctrl_id=7, qid=1, tag=4)] = _start(5_000, 4)       # a controller the topology does not list
    ctrls = {1: _ctrl(1, ("nvme1n1", "nvme1n1"))}
    now = [0.0]

    def sleep(s):
        now[0] += s

    ended, still = settle.nvme_commands(start, ctrls, str(tmp_path), timeout=0.1, sleep=sleep, clock=lambda: now[0])
    assert ended == [] and still == 2 and len(start) == 2 and now[0] >= 0.1
    # it completes (traced: the probe removes it) while kvtrace waits: nothing to settle
    calls = []

    def sleep2(s):
        calls.append(s)
        start.clear()

    assert settle.nvme_commands(start_with(start, K(ctrl_id=1, qid=1, tag=4), _start(6_000, 4)), ctrls, str(tmp_path),
                         timeout=5, sleep=sleep2, clock=lambda: 0.0) == ([], 0)
    assert len(calls) == 1


def start_with(m, k, v):
    m[k] = v
    return m
