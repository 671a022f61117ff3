"""Recorded sysfs trees (tests/data/sysfs/*.tree) laid out under a temporary root.

A tree file holds one entry per line (``#`` starts a comment):

    /sys/class/nvme/nvme0 -> ../../devices/virtual/nvme-fabrics/ctl/nvme0     a symlink
    /sys/devices/.../transport = tcp                                           a file
    /sys/.../hw_counters/out_of_sequence = 4294967000 | 200 | 500              a file per poll step
    /sys/.../empty_dir/                                                        a directory

Steps are separated by `` | ``; the last one repeats.  ``<absent>`` means the file does not
exist at that step, ``<error>`` makes reading it fail (a directory stands in for the file),
``<empty>`` is an empty file.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "sysfs"


def entries(name: str) -> list[tuple[str, str, object]]:
    out = []
    for raw in (DATA / name).read_text().splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if " -> " in line:
            path, target = line.split(" -> ", 1)
            out.append(("link", path.strip(), target.strip()))
        elif " = " in line:
            path, value = line.split(" = ", 1)
            out.append(("file", path.strip(), [v.strip() for v in value.split(" | ")]))
        elif line.rstrip().endswith("/"):
            out.append(("dir", line.strip(), None))
        else:
            raise ValueError(f"{name}: cannot read {raw!r}")
    return out


def steps(name: str) -> int:
    return max((len(v) for kind, _, v in entries(name) if kind == "file"), default=1)


def materialize(name: str, root: Path, step: int = 0) -> Path:
    """Lay tree ``name`` out under ``root`` as it is at poll ``step`` (files rewritten in place,
    so open file descriptors see the new content)."""
    root = Path(root)
    for kind, path, value in entries(name):
        p = root / path.lstrip("/")
        if kind == "dir":
            p.mkdir(parents=True, exist_ok=True)
        elif kind == "link":
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.is_symlink():
                os.symlink(value, p)
        else:
            v = value[min(step, len(value) - 1)]
            p.parent.mkdir(parents=True, exist_ok=True)
            if v == "<absent>":
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
                continue
            if v == "<error>":
                if p.exists() and not p.is_dir():
                    p.unlink()
                p.mkdir(exist_ok=True)
                continue
            if p.is_dir():
                shutil.rmtree(p)
            text = "" if v == "<empty>" else v.replace("\\n", "\n") + "\n"
            with open(p, "r+" if p.exists() else "w") as f:  # in place: same inode
                f.seek(0)
                f.write(text)
                f.truncate()
    return root


def mlx5_four_ports(root: Path) -> Path:
    """rdma-mlx5.tree at step 0 with mlx5_0's PCI function copied twice (mlx5_2, mlx5_3): four
    mlx5 ports, about 217 counters (the NIC poller's unit test and bench/nic_poll.py)."""
    root = Path(root)
    materialize("rdma-mlx5.tree", root, 0)
    base = root / "sys/devices/pci0000:3a/0000:3a:00.0"
    for i in (2, 3):
        shutil.copytree(base / "0000:3b:00.0", base / f"0000:3b:00.{i}", symlinks=True)
        os.rename(base / f"0000:3b:00.{i}/infiniband/mlx5_0", base / f"0000:3b:00.{i}/infiniband/mlx5_{i}")
        os.symlink(f"../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.{i}/infiniband/mlx5_{i}",
                   root / f"sys/class/infiniband/mlx5_{i}")
    return root
