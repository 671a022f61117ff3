"""Fixtures for privileged capture tests: loop devices backed by files, page-cache drops."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def disk_stat(dev: str) -> dict:
    """/sys/block/<dev>/stat: the kernel's own I/O accounting for the device."""
    f = Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()
    return {"reads": int(f[0]), "read_sectors": int(f[2]), "writes": int(f[4]), "write_sectors": int(f[6])}


@pytest.fixture
def loopdev(tmp_path):
    """A 64 MiB loop device over a file of random-ish data (direct I/O to the backing file)."""
    img = tmp_path / "disk.img"
    with open(img, "wb") as f:
        for i in range(64):
            f.write(bytes([i]) * (1 << 20))
    dev = sh("losetup", "--find", "--show", "--direct-io=on", str(img))
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


@pytest.fixture
def ext4_on_loop(tmp_path):
    """An ext4 filesystem on a loop device, mounted at tmp/mnt, holding a 16 MiB file."""
    img = tmp_path / "fs.img"
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    sh("mkfs.ext4", "-q", "-F", str(img))
    dev = sh("losetup", "--find", "--show", str(img))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        sh("mount", dev, str(mnt))
        data = mnt / "kvblocks.bin"
        with open(data, "wb") as f:
            f.write(os.urandom(16 << 20))
            f.flush()
            os.fsync(f.fileno())
        # remount read-only: the file's pages leave the page cache with the old mount's state
        sh("umount", str(mnt))
        sh("mount", "-o", "ro", dev, str(mnt))
        yield dev, data
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        subprocess.run(["losetup", "-d", dev], check=False)
