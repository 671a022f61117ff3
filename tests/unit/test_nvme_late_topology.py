"""A controller connected during the capture: its commands reach the decoder before the
topology watcher's periodic scan lists it, and the probe counted its data commands in
512-byte LBAs (its namespace was not in nvme_ns yet).  The decoder has the watcher rescan at
once, so every row has the transport and target, and bytes are recomputed from nlb and the
namespace's LBA size (rows and the per-queue totals alike).  Recorded tracepoint records
(6.1 layout) through NvmeReference (tests/bpf_reference.py); the sysfs tree appears under the watcher's root
after it started.  No root."""
from __future__ import annotations

import numpy as np

from kvtrace.capture import nvme
from kvtrace.capture.events import DecodeContext
from kvtrace.attach import fabric as session
from kvtrace.capture.kstats import KernelMaps
from tests.sysfs_tree import materialize
from tests.unit.test_fabric_session import FakeMap, K, qstat
from tests.unit.test_nvme_probe import Run, cdw

READ, WRITE = 0x02, 0x01


def late_controller_run() -> Run:
    """nvme0 (NVMe/TCP, namespace 1 with 4096-byte LBAs in nvme.tree) as the probe sees it
    before user space told it the namespace: nothing in nvme_ns."""
    r = Run("6.1", ns={})
    d0 = b"nvme0c0n1"
    r.setup(1_000_000, 0, 0, 0, 1, 0x7F, nsid=0, fctype=0x01, pid=50, tid=50, comm="nvme")   # fabrics connect
    r.complete(1_100_000, 0, 0, 0, 1)
    r.setup(2_000_000, 0, 2, 1, 17, READ, disk=d0, pid=4242, tid=4243, comm="kvreader", cdw10=cdw(1000, 8))
    r.complete(2_050_000, 0, 2, 1, 17, disk=d0)
    r.setup(3_000_000, 0, 2, 1, 18, READ, disk=d0, pid=4242, tid=4243, comm="kvreader", cdw10=cdw(2000, 64))
    r.complete(3_070_000, 0, 2, 1, 18, disk=d0)
    r.setup(4_000_000, 0, 1, 2, 19, WRITE, disk=d0, pid=4242, tid=4244, comm="kvwriter", cdw10=cdw(64, 2))
    r.complete(4_400_000, 0, 1, 2, 19, status=0x302, disk=d0)   # failed: no bytes in the totals
    return r


def test_the_probe_flags_commands_of_namespaces_it_does_not_know():
    r = late_controller_run()
    ev = [e for e in (nvme.decode_array([x], nvme.DTYPE)[0] for x in r.ref.events)]
    reads = [e for e in ev if e["opcode"] == READ]
    assert [(int(e["nlb"]), int(e["bytes"]), int(e["xflags"])) for e in reads] == [(8, 4096, 1), (64, 32768, 1)]
    assert [int(e["xflags"]) for e in ev if e["qid"] == 0] == [0]   # admin/fabrics: no LBAs, no flag
    # the map user space corrects the totals with: successful data commands only
    assert r.ref.lbafix == {(0, 1, 2, 0): 72}
    assert r.ref.qstats[(0, 2, 0)]["bytes"] == 72 * 512
    # a namespace the probe knows is not flagged
    known = Run("6.1", ns={(0, 1): (0, 0, 12)})
    known.setup(1, 0, 2, 0, 1, READ, cdw10=cdw(0, 8))
    known.complete(2, 0, 2, 0, 1)
    (e,) = nvme.decode_array(known.ref.events, nvme.DTYPE)
    assert (int(e["bytes"]), int(e["xflags"])) == (32768, 0) and known.ref.lbafix == {}


def test_unknown_controller_is_rescanned_at_once_and_rows_are_whole(tmp_path):
    ctx = DecodeContext()
    w = session.TopologyWatcher(ctx, {"nvme_ns": FakeMap()}, interval=3600, root=str(tmp_path))
    assert ctx.nvme_ctrls == {} and w.drain() == {} and ctx.nvme_rescan == w.rescan
    materialize("nvme.tree", tmp_path, 0)          # nvme connect: the controllers appear
    r = late_controller_run()
    out = nvme.decode(r.ref.events, ctx)           # before the watcher's next periodic scan
    rows = out[nvme.TABLE].to_pylist()
    assert w.demand_scans == 1 and w.scans == 2
    assert {(x["ctrl"], x["transport"], x["traddr"]) for x in rows} == {("nvme0", "tcp", "10.10.0.2:4420")}
    by = {x["cid"]: x for x in rows}
    # bytes recomputed from nlb and the namespace's 4096-byte LBAs, failed command included
    assert [(by[(1 << 12) | c]["nlb"], by[(1 << 12) | c]["bytes"]) for c in (17, 18)] == [(8, 32768), (64, 262144)]
    assert (by[(2 << 12) | 19]["bytes"], by[(2 << 12) | 19]["status_text"]) == (2 * 4096, "ANA inaccessible")
    assert by[1]["bytes"] == 0 and by[1]["op"] == "connect"
    # the rescan's rows (appeared) go out with the next drain; the probe is told the namespace
    t = w.drain()
    assert {x["event"] for x in t["nvme_ctrl"].to_pylist()} == {"appeared"}
    assert w.t["nvme_ns"][(("ctrl_id", 0), ("nsid", 1))].lba_shift == 12
    # known now: decoding again rescans nothing
    nvme.decode(r.ref.events, ctx)
    assert w.demand_scans == 1


def test_rescans_on_demand_are_rate_limited(tmp_path, monkeypatch):
    ctx = DecodeContext()
    now = [1000.0]
    monkeypatch.setattr(session.time, "monotonic", lambda: now[0])
    w = session.TopologyWatcher(ctx, {}, interval=3600, root=str(tmp_path), demand_interval=1.0)
    assert w.rescan(ctrls=[9]) is True             # never looked for: at once
    assert w.rescan(ctrls=[9]) is False            # looked for in vain just now
    assert w.rescan(ctrls=[7], namespaces=[(9, 1)]) is True   # others not looked for yet: at once
    assert w.rescan(ctrls=[7, 9]) is False
    now[0] += 1.5
    assert w.rescan(ctrls=[9]) is True             # again, once the interval passed
    assert w.demand_scans == 3
    materialize("nvme.tree", tmp_path, 0)
    now[0] += 0.1
    assert w.rescan(ctrls=[0]) is True and 0 in ctx.nvme_ctrls   # a new id: at once, found
    assert w.rescan(ctrls=[0, 1, 2]) is False      # all known: no scan
    assert ctx.nvme_lba[(0, 1)] == 4096


def test_queue_totals_get_the_bytes_512_byte_lbas_left_out(tmp_path):
    """nvme_queue's bytes: the map counted nlb << 9 for the late namespace; nvme_lbafix holds
    those blocks, and the rows add nlb * (lba - 512) once the topology knows the LBA size."""
    r = late_controller_run()
    qs, fix = FakeMap(), FakeMap()
    for (c, q, o), v in r.ref.qstats.items():
        qs[K(ctrl_id=c, qid=q, opclass=o)] = qstat(**{k: v[k] for k in v if k != "sq_occ_max"})
    for (c, n, q, o), blocks in r.ref.lbafix.items():
        fix[K(ctrl_id=c, nsid=n, qid=q, opclass=o)] = blocks
    ctx = DecodeContext()
    w = session.TopologyWatcher(ctx, {}, interval=3600, root=str(tmp_path))
    km = KernelMaps({"nvme_qstats": qs, "nvme_hist": FakeMap(), "nvme_lbafix": fix}, ctx)
    # the namespace is not in sysfs yet: the blocks wait, counted, and the bytes stay as counted
    out = km.drain()
    rows = {(x["qid"], x["opclass"]): x for x in out["nvme_queue"].to_pylist()}
    assert rows[(2, "read")]["bytes"] == 72 * 512 and km.stats()["lba_unknown_blocks"] == 72
    assert w.demand_scans == 1
    # it appears: the next flush adds what was left out, though no new command completed
    materialize("nvme.tree", tmp_path, 0)
    w.last_demand -= 1.0                           # the next flush, a second later
    out = km.drain()
    rows = {(x["qid"], x["opclass"]): x for x in out["nvme_queue"].to_pylist()}
    assert rows == {(2, "read"): rows[(2, "read")]}
    assert (rows[(2, "read")]["bytes"], rows[(2, "read")]["completions"]) == (72 * (4096 - 512), 0)
    assert km.stats()["lba_fixed_blocks"] == 72 and km.stats()["lba_unknown_blocks"] == 0
    assert km.drain() == {}
    # with the topology known at the first flush, the totals are right in the same row
    qs2 = FakeMap({k: v for k, v in qs.items()})
    km2 = KernelMaps({"nvme_qstats": qs2, "nvme_hist": FakeMap(), "nvme_lbafix": fix}, ctx)
    rows = {(x["qid"], x["opclass"]): x for x in km2.drain()["nvme_queue"].to_pylist()}
    assert rows[(2, "read")]["bytes"] == 72 * 4096 == 8 * 4096 + 64 * 4096
    assert rows[(1, "write")]["bytes"] == 0     # the failed write moved no bytes


def test_without_a_watcher_the_decoder_keeps_what_the_probe_counted():
    r = late_controller_run()
    rows = nvme.decode(r.ref.events, DecodeContext())[nvme.TABLE].to_pylist()
    assert {x["transport"] for x in rows} == {""}
    assert sorted(x["bytes"] for x in rows if x["opcode"] == READ) == [4096, 32768]


def test_hidden_path_disks_with_a_dev_are_named_and_told_to_the_probe(tmp_path):
    """On 6.1 a native-multipath path disk (nvme0c0n1) is hidden but has a dev number: block
    tracepoints report it, /sys/dev/block has no link for it.  The topology names it and tells
    the nvme probe that dev, so block records and NVMe commands meet."""
    from kvtrace.capture import blockio
    from kvtrace.fabric.sysfs import kernel_dev

    materialize("nvme.tree", tmp_path, 0)
    path_dev = tmp_path / "sys/devices/virtual/nvme-fabrics/ctl/nvme0/nvme0c0n1/dev"
    path_dev.write_text("259:7\n")
    ctx = DecodeContext()
    ns_map = FakeMap()
    w = session.TopologyWatcher(ctx, {"nvme_ns": ns_map}, interval=3600, root=str(tmp_path))
    leaf = ns_map[(("ctrl_id", 0), ("nsid", 1))]
    assert (leaf.dev1, leaf.dev2) == (kernel_dev(259, 7), kernel_dev(259, 0))
    assert ctx.dev_name(kernel_dev(259, 7)) == "nvme0c0n1" and w.demand_scans == 0
    # a dev the topology did not list yet: one rescan, then named
    ctx2 = DecodeContext()
    path_dev.unlink()
    w2 = session.TopologyWatcher(ctx2, {}, interval=3600, root=str(tmp_path))
    path_dev.write_text("259:7\n")
    ev = np.zeros(1, dtype=blockio.DTYPE)
    ev["kind"], ev["size"], ev["ts"], ev["ts_start"], ev["ts_issue"] = 1, blockio.DTYPE.itemsize, 3000, 1000, 2000
    ev["dev"], ev["sector"], ev["bytes"], ev["weight"], ev["rwbs"] = kernel_dev(259, 7), 8, 262144, 1, b"R"
    row = blockio.decode([ev.tobytes()], ctx2).to_pylist()[0]
    assert (row["disk"], row["bytes"], row["dev_major"], row["dev_minor"]) == ("nvme0c0n1", 262144, 259, 7)
    assert w2.demand_scans == 1


def test_a_hidden_path_without_a_sysfs_dev_is_learned_from_the_remaps(tmp_path):
    """6.1 as the lab shows it: the path disk nvme0c0n1 has no `dev` in sysfs, yet block
    tracepoints report one (259:9).  blockio's block_remaps map says a traced bio went from the
    head (259:0) to 259:9: with one path of that head on this host, 259:9 is that path."""
    from kvtrace.capture import blockio
    from kvtrace.fabric.sysfs import kernel_dev

    materialize("nvme.tree", tmp_path, 0)
    ctx = DecodeContext()
    remaps, ns_map = FakeMap(), FakeMap()
    w = session.TopologyWatcher(ctx, {"nvme_ns": ns_map, "block_remaps": remaps}, interval=3600, root=str(tmp_path))
    assert ns_map[(("ctrl_id", 0), ("nsid", 1))].dev1 == 0
    remaps[kernel_dev(259, 9)] = kernel_dev(259, 0)    # the reader's first bio through the head
    ev = np.zeros(1, dtype=blockio.DTYPE)
    ev["kind"], ev["size"], ev["ts"], ev["ts_start"], ev["ts_issue"] = 1, blockio.DTYPE.itemsize, 3000, 1000, 2000
    ev["dev"], ev["sector"], ev["bytes"], ev["weight"], ev["rwbs"] = kernel_dev(259, 9), 8, 262144, 1, b"R"
    row = blockio.decode([ev.tobytes()], ctx).to_pylist()[0]
    # both controllers' paths of nvme.tree lead to head nvme0n1: ambiguous, so named by the head
    assert row["disk"] == "nvme0n1" and w.demand_scans == 1
    assert ns_map[(("ctrl_id", 0), ("nsid", 1))].dev1 == 0
    # with one path (the RDMA controller gone), the dev is that path's: named, and told to the probe
    import shutil

    shutil.rmtree(tmp_path / "sys/devices/virtual/nvme-fabrics/ctl/nvme1")
    (tmp_path / "sys/class/nvme/nvme1").unlink()
    ctx2 = DecodeContext()
    ns2 = FakeMap()
    session.TopologyWatcher(ctx2, {"nvme_ns": ns2, "block_remaps": remaps}, interval=3600, root=str(tmp_path))
    assert ns2[(("ctrl_id", 0), ("nsid", 1))].dev1 == kernel_dev(259, 9)
    assert blockio.decode([ev.tobytes()], ctx2).to_pylist()[0]["disk"] == "nvme0c0n1"
