"""NVMe topology from a recorded sysfs tree (tests/data/sysfs/nvme.tree): transports and
targets, multipath heads and their paths with ANA state, the hctx -> CPU map, block
devices and files mapped back to the controllers their I/O goes through, and changes
(reset, reconnect, ANA transition, controller gone) recorded as rows.  No root."""
from __future__ import annotations

import os

from kvtrace.fabric import topology
from kvtrace.fabric.sysfs import kernel_dev, parse_cpulist
from tests.sysfs_tree import materialize


def scan(tmp_path, step=0):
    materialize("nvme.tree", tmp_path, step)
    return topology.scan(tmp_path)


def test_controllers_transports_and_targets(tmp_path):
    t = scan(tmp_path)
    c = t.controllers
    assert {i: (x.transport, x.target, x.state) for i, x in c.items()} == {
        0: ("tcp", "10.10.0.2:4420", "live"), 1: ("rdma", "10.20.0.2:4420", "live"), 2: ("pcie", "0000:00:04.0", "live")}
    assert c[0].src_addr == "10.10.0.1" and c[0].subsystem == "nvme-subsys0" and c[1].subsystem == "nvme-subsys0"
    assert c[0].subsysnqn == c[1].subsysnqn == "nqn.2024-01.io.example:kvstore"
    assert t.subsystems["nvme-subsys0"].iopolicy == "numa" and t.subsystems["nvme-subsys0"].heads == ["nvme0n1"]
    assert t.queue_depths() == {2: 1024}   # PCIe only: sqsize is 0-based


def test_multipath_heads_paths_ana_and_hctx(tmp_path):
    t = scan(tmp_path)
    paths = {ns.disk: ns for ns in t.by_head("nvme0n1")}
    assert set(paths) == {"nvme0c0n1", "nvme0c1n1"}
    assert (paths["nvme0c0n1"].ctrl, paths["nvme0c0n1"].ana_state, paths["nvme0c0n1"].ana_grpid) == ("nvme0", "optimized", 1)
    assert (paths["nvme0c1n1"].ctrl, paths["nvme0c1n1"].ana_state) == ("nvme1", "non-optimized")
    for ns in paths.values():
        assert ns.multipath and ns.nsid == 1 and ns.lba_bytes == 4096 and ns.size_bytes == 100 << 30
        assert ns.head_dev == (259, 0) and ns.disk_dev is None      # hidden path disk
        assert [(h.qid, h.cpus, h.nr_tags) for h in ns.hctx] == [(1, [0], 128), (2, [1], 128)]
        assert ns.mounts == ["/mnt/kvfab"]
    (pcie,) = t.by_head("nvme2n1")
    assert not pcie.multipath and pcie.disk_dev == (259, 2) and pcie.lba_shift == 9 and pcie.mounts == ["/mnt/kv"]


def test_devices_and_files_map_to_transport_and_target(tmp_path):
    t = scan(tmp_path)
    via = lambda nss: sorted((ns.ctrl, t.controllers[ns.ctrl_id].transport, t.controllers[ns.ctrl_id].target) for ns in nss)
    # an LVM volume on the fabrics head: both paths, TCP and RDMA
    assert via(t.for_dev(254, 0)) == [("nvme0", "tcp", "10.10.0.2:4420"), ("nvme1", "rdma", "10.20.0.2:4420")]
    assert via(t.for_dev(259, 0)) == via(t.for_dev(254, 0))
    # a partition of the PCIe drive
    assert via(t.for_dev(259, 3)) == [("nvme2", "pcie", "0000:00:04.0")]
    # files: by their filesystem's mount (this tree is not this host, so by mountinfo)
    assert via(t.for_path("/mnt/kvfab/blocks/00ff.kv")) == via(t.for_dev(254, 0))
    assert via(t.for_path("/mnt/kv/chunk-1")) == [("nvme2", "pcie", "0000:00:04.0")]
    assert t.for_path("/home/user/x") == [] and t.for_dev(254, 16) == [] and t.for_dev(8, 0) == []


def test_what_the_bpf_side_is_told(tmp_path):
    t = scan(tmp_path)
    assert t.bpf_namespaces() == {
        (0, 1): (0, kernel_dev(259, 0), 12),   # hidden path disk: block layer reports dev 0; bios go to the head
        (1, 1): (0, kernel_dev(259, 0), 12),
        (2, 1): (kernel_dev(259, 2), 0, 9),
    }


def test_reset_reconnect_and_ana_change_are_rows(tmp_path):
    snaps = [scan(tmp_path, s) for s in range(5)]
    c, n, h = topology.changes(None, snaps[0], 1)
    assert {r["event"] for r in c + n} == {"snapshot"} and len(c) == 3 and len(n) == 3 and len(h) == 6
    assert {(r["ctrl"], r["transport"], r["target"]) for r in c} == {
        ("nvme0", "tcp", "10.10.0.2:4420"), ("nvme1", "rdma", "10.20.0.2:4420"), ("nvme2", "pcie", "0000:00:04.0")}
    events = []
    for a, b in zip(snaps, snaps[1:]):
        c, n, _ = topology.changes(a, b, 2)
        events.append(sorted([(r["ctrl"], r["event"], r["state"]) for r in c] +
                             [(r["disk"], r["event"], r["ana_state"]) for r in n]))
    assert events == [
        [],
        [("nvme0", "changed", "resetting")],
        [("nvme0", "changed", "connecting"), ("nvme0c0n1", "changed", "inaccessible")],
        [("nvme0", "changed", "live"), ("nvme0c0n1", "changed", "optimized")],
    ]


def test_a_controller_that_goes_away_and_odd_files(tmp_path):
    before = scan(tmp_path)
    os.unlink(tmp_path / "sys/class/nvme/nvme1")
    (tmp_path / "sys/devices/virtual/nvme-fabrics/ctl/nvme0/address").write_text("\x00\xff garbage")
    (tmp_path / "sys/devices/virtual/nvme-fabrics/ctl/nvme0/sqsize").write_text("not a number\n")
    (tmp_path / "sys/devices/virtual/nvme-fabrics/ctl/nvme0/nvme0c0n1/mq/1/cpu_list").write_text("x-y,,7")
    after = topology.scan(tmp_path)
    c, n, _ = topology.changes(before, after, 3)
    assert ("nvme1", "vanished") in {(r["ctrl"], r["event"]) for r in c}
    assert ("nvme0c1n1", "vanished") in {(r["disk"], r["event"]) for r in n}
    c0 = after.controllers[0]
    assert c0.traddr == "" and c0.sqsize is None and c0.transport == "tcp"
    assert [h.cpus for h in c0.namespaces[0].hctx] == [[0], [7]]
    assert topology.scan(tmp_path / "nonexistent").controllers == {}


def test_cpulists():
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("0, 1") == [0, 1]
    assert parse_cpulist("") == [] and parse_cpulist(None) == [] and parse_cpulist("5-2") == []
