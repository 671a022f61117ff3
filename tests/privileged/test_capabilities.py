"""kvtrace as uid 0 with only some capabilities (setpriv drops the rest): `kvtrace doctor` names
exactly the ones dropped, and the measured least sets really capture.

Two attaches (each pays bcc's compile): the capture set alone (CAP_BPF + CAP_PERFMON) on a
gated command, and the deployed agent's set (kvtrace.host.privileges.AGENT_LEAST) on a
process of another user, whose descriptor opened before the attach must still get its path.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.host import privileges

pytestmark = pytest.mark.root
NAMES = [c.name for c in privileges.CAPABILITIES]
FILE = os.path.realpath("/etc/os-release")   # world-readable: another user's process reads it too


def _setpriv_prefix(keep) -> list[str]:
    spec = ",".join(["-all", *(f"+{n.removeprefix('CAP_').lower()}" for n in keep)])
    return ["setpriv", f"--inh-caps={spec}", f"--ambient-caps={spec}", f"--bounding-set={spec}", "--"]


@pytest.fixture(autouse=True)
def _tools():
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    lacking = [c.name for c in privileges.CAPABILITIES if not privileges.has_cap(c.number)]
    if lacking:
        pytest.skip(f"this root lacks {', '.join(lacking)} itself: nothing to drop them from")


def kvtrace_with(keep, *args, timeout=60, **kw) -> subprocess.CompletedProcess:
    cmd = [*_setpriv_prefix(keep), sys.executable, "-m", "kvtrace", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def doctor(keep) -> tuple[dict, int]:
    p = kvtrace_with(keep, "doctor", "--json")
    return json.loads(p.stdout), p.returncode


@pytest.mark.parametrize("keep", [
    [],
    ["CAP_BPF"],
    ["CAP_BPF", "CAP_PERFMON"],
    ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE"],
    ["CAP_SYS_ADMIN"],
    ["CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE"],
    list(privileges.AGENT_LEAST),
], ids=lambda keep: "+".join(n.removeprefix("CAP_").lower() for n in keep) or "none")
def test_doctor_names_exactly_the_dropped_capabilities(keep):
    data, rc = doctor(keep)
    named = [m["name"] for m in data["missing_capabilities"]]
    assert named == [n for n in NAMES if n not in keep]
    rows = {c["name"]: c for c in data["checks"]}
    assert {n for n in NAMES if rows[n]["status"] == "missing"} == set(named)
    can = "CAP_SYS_ADMIN" in keep or {"CAP_BPF", "CAP_PERFMON"} <= set(keep)
    assert data["capture_available"] is can and rc == (0 if can else 1)
    for m in data["missing_capabilities"]:
        expected = privileges.BY_NAME[m["name"]].cost
        stands_in = m["name"] in privileges.CAPTURE and can
        assert m["cost"] == expected or (stands_in and "CAP_SYS_ADMIN" in m["cost"])


def test_doctor_table_says_what_each_missing_capability_costs():
    p = kvtrace_with(["CAP_BPF", "CAP_PERFMON"], "doctor")
    assert p.returncode == 0
    lines = [l for l in p.stdout.splitlines() if l.startswith("kvtrace: CAP_")]
    assert lines == [f"kvtrace: {c.name} missing: {c.cost}" for c in privileges.CAPABILITIES
                     if c.name not in privileges.CAPTURE]
    assert "kvtrace: CAP_SYS_PTRACE missing: no live injection into vLLM (kernel probes, KV events and /metrics still run)" in p.stdout


def _file_reads(ds: Dataset, pid: int) -> list[dict]:
    return [r for r in ds.table("file_io").to_pylist()
            if r["path"] == FILE and r["pid"] == pid and r["syscall"] in ("read", "pread64")]


def test_capture_set_alone_records_a_gated_commands_reads(tmp_path):
    """CAP_BPF + CAP_PERFMON: every byte dd read from the file, in read calls of dd's pid."""
    size = os.path.getsize(FILE)
    out = tmp_path / "ds"
    p = kvtrace_with(list(privileges.CAPTURE), "attach", "--quiet", "--out", str(out), "--",
                     "/bin/sh", "-c", f"exec dd if={FILE} of=/dev/null bs=100", timeout=300)
    assert p.returncode == 0, p.stderr
    ds = Dataset.open(out)
    (dd,) = {r["pid"] for r in ds.table("file_io").to_pylist() if r["path"] == FILE}
    reads = _file_reads(ds, dd)
    assert sum(r["bytes"] for r in reads) == size
    assert len(reads) == -(-size // 100) + 1    # full blocks, the tail, and the read that returned 0
    (run,) = ds.runs()
    assert run["status"] == "complete" and run["lost_events"] == {}


TARGET = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(5):
    os.pread(fd, 1 << 16, 0)
"""


def test_agent_set_resolves_another_users_descriptors(tmp_path):
    """AGENT_LEAST (with CAP_SYS_PTRACE and CAP_DAC_OVERRIDE): a process of uid 65534 read a
    descriptor it opened before the attach; each read is a row with the file's path."""
    target = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                               "/usr/bin/python3", "-c", TARGET, FILE],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        out = tmp_path / "ds"
        agent = subprocess.Popen([*_setpriv_prefix(privileges.AGENT_LEAST), sys.executable, "-m", "kvtrace", "attach",
                                  "--quiet", "--pid", str(target.pid), "--out", str(out)],
                                 stderr=subprocess.PIPE, text=True)
        line = next((x for x in iter(agent.stderr.readline, "") if "attached" in x), "")
        assert "attached" in line, line
        target.stdin.write("go\n")
        target.stdin.close()
        assert target.wait(60) == 0
        assert agent.wait(120) == 0   # stops by itself once the traced process exited
    finally:
        target.kill()
    reads = _file_reads(Dataset.open(out), target.pid)
    assert len(reads) == 5 and all(r["bytes"] == os.path.getsize(FILE) for r in reads)
