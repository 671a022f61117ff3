"""`kvtrace doctor` lists NVMe controllers with their transport and RDMA devices with their
counters, or says there are none.  No root."""
from __future__ import annotations

import json

from kvtrace.doctor import checks
from tests.conftest import run_kvtrace
from tests.sysfs_tree import materialize


def test_controllers_and_rdma_devices_from_a_recorded_tree(tmp_path):
    materialize("nvme.tree", tmp_path)
    materialize("rdma-mlx5.tree", tmp_path)
    rows = {c.name: c for c in checks._fabric(str(tmp_path))}
    assert rows["NVMe nvme0 (tcp)"].ok and "10.10.0.2:4420" in rows["NVMe nvme0 (tcp)"].detail
    assert "nvme0c0n1->nvme0n1 ana=optimized" in rows["NVMe nvme0 (tcp)"].detail
    assert "10.20.0.2:4420" in rows["NVMe nvme1 (rdma)"].detail and "0000:00:04.0" in rows["NVMe nvme2 (pcie)"].detail
    assert rows["RDMA mlx5_0 (mlx5)"].detail == (
        "port 1: eth2 Ethernet ACTIVE 100 Gb/sec (2X HDR), 21 counters, 31 hw_counters; device: 3 hw_counters")
    assert "NVMe controllers" not in rows and "RDMA devices" not in rows


def test_doctor_says_there_are_none_here():
    p = run_kvtrace("doctor", "--json")
    rows = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    for name in ("NVMe controllers", "RDMA devices"):
        if name in rows:  # this machine: no NVMe, no RDMA
            assert rows[name]["status"] == "absent" and rows[name]["detail"].startswith("none on this host")
    assert any(n.startswith("NVMe") for n in rows) and any(n.startswith("RDMA") for n in rows)
    assert rows["pyroute2"]["status"] == "ok"
