"""`kvtrace doctor` lists NVMe controllers with their transport and RDMA devices with their
counters, or says there are none.  No root."""
from __future__ import annotations

import json

from kvtrace.doctor import checks
from tests.conftest import run_kvtrace
from tests.sysfs_tree import materialize


def fabric_rows(root):
    """The NVMe and RDMA rows of `kvtrace doctor` for the sysfs tree under ``root``."""
    return {c.name: c for c in checks._fabric(str(root)) if c.name.startswith(("NVMe", "RDMA"))}


def test_controllers_and_rdma_devices_from_a_recorded_tree(tmp_path):
    materialize("nvme.tree", tmp_path)
    materialize("rdma-mlx5.tree", tmp_path)
    rows = fabric_rows(tmp_path)
    assert sorted(rows) == ["NVMe nvme0 (tcp)", "NVMe nvme1 (rdma)", "NVMe nvme2 (pcie)",
                            "RDMA mlx5_0 (mlx5)", "RDMA mlx5_1 (mlx5)"]
    assert all(c.ok for c in rows.values())
    assert "10.10.0.2:4420" in rows["NVMe nvme0 (tcp)"].detail
    assert "nvme0c0n1->nvme0n1 ana=optimized" in rows["NVMe nvme0 (tcp)"].detail
    assert "10.20.0.2:4420" in rows["NVMe nvme1 (rdma)"].detail and "0000:00:04.0" in rows["NVMe nvme2 (pcie)"].detail
    assert rows["RDMA mlx5_0 (mlx5)"].detail == (
        "port 1: eth2 Ethernet ACTIVE 100 Gb/sec (2X HDR), 21 counters, 31 hw_counters; device: 3 hw_counters")
    assert rows["RDMA mlx5_1 (mlx5)"].detail == "port 1: eth3 Ethernet ACTIVE 100 Gb/sec (2X HDR), 21 counters, 31 hw_counters"


def test_nvme_only_says_there_is_no_rdma(tmp_path):
    materialize("nvme.tree", tmp_path)
    rows = fabric_rows(tmp_path)
    assert sorted(rows) == ["NVMe nvme0 (tcp)", "NVMe nvme1 (rdma)", "NVMe nvme2 (pcie)", "RDMA devices"]
    assert rows["RDMA devices"].status == "absent"


def test_an_empty_tree_says_there_are_none(tmp_path):
    rows = fabric_rows(tmp_path)
    assert sorted(rows) == ["NVMe controllers", "RDMA devices"]
    for c in rows.values():
        assert c.status == "absent" and not c.ok and c.detail.startswith("none on this host")


def test_doctor_lists_the_fabric_rows():
    """The command itself, on this host (whatever fabric it has): its rows are there."""
    p = run_kvtrace("doctor", "--json")
    rows = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert any(n.startswith("NVMe") for n in rows) and any(n.startswith("RDMA") for n in rows)
    assert rows["pyroute2"]["status"] == "ok"
