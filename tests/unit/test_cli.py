"""CLI errors: one line, no traceback, the documented exit code."""
from __future__ import annotations

import os

import pytest

from tests.conftest import run_kvtrace


def one_line_error(p, code):
    assert p.returncode == code, (p.returncode, p.stderr)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtrace: "), p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


def test_attach_without_target_says_what_to_give(tmp_path):
    """No --pid and no command: kvtrace looks for vLLM servers; unless exactly one is chosen
    it lists what it found (if anything) and ends with one line saying what to give."""
    p = run_kvtrace("attach", "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    last = [l for l in p.stderr.splitlines() if l.strip()][-1]
    assert last.startswith("kvtrace: ") and "--pid" in last
    assert not (tmp_path / "o").exists()


def test_attach_bad_options():
    assert "--ringbuf-pages" in one_line_error(run_kvtrace("attach", "--pid", "1", "--out", "/tmp/x", "--ringbuf-pages", "1000"), 2)
    assert "--duration" in one_line_error(run_kvtrace("attach", "--pid", "1", "--out", "/tmp/x", "--duration", "-1"), 2)
    one_line_error(run_kvtrace("attach", "--pid", "notanumber", "--out", "/tmp/x"), 2)


def _world_readable(path: str) -> bool:
    import stat

    p = os.path.realpath(path)
    while p != "/":
        if not os.stat(p).st_mode & stat.S_IXOTH:
            return False
        p = os.path.dirname(p)
    return True


def _setpriv(args, tmp_path):
    import shutil
    import subprocess
    import sys

    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) missing")
    return subprocess.run(["setpriv", *args, sys.executable, "-m", "kvtrace", "attach", "--pid", "1", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60, cwd="/")


def test_non_root_is_refused_naming_root(tmp_path):
    import sys

    if os.geteuid() != 0:
        p = run_kvtrace("attach", "--pid", str(os.getpid()), "--out", str(tmp_path / "o"))
    else:
        if not (_world_readable(sys.executable) and _world_readable(os.path.dirname(__file__))):
            pytest.skip("the venv or checkout is not readable by an unprivileged user here")
        os.chmod(tmp_path, 0o777)
        p = _setpriv(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"], tmp_path)
    line = one_line_error(p, 2)
    assert "root" in line and "nothing was attached" in line
    assert not (tmp_path / "o").exists()


def test_root_without_capabilities_is_refused_naming_them(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop capabilities from")
    p = _setpriv(["--inh-caps=-all", "--bounding-set=-all"], tmp_path)
    line = one_line_error(p, 2)
    assert "CAP_BPF" in line and "CAP_PERFMON" in line and "nothing was attached" in line
    assert not (tmp_path / "o").exists()


def test_summary_of_a_missing_dataset(tmp_path):
    line = one_line_error(run_kvtrace("summary", str(tmp_path / "none")), 6)
    assert "no dataset" in line


def test_doctor_json_lists_every_family():
    import json

    p = run_kvtrace("doctor", "--json")
    data = json.loads(p.stdout)
    names = {c["name"] for c in data["checks"]}
    for fam in ("io_uring", "nvme", "rdma_core", "rdma_cma", "tcp", "syscalls read/pread/readv"):
        assert f"tracepoints: {fam}" in names
    assert {"root", "CAP_BPF", "CAP_PERFMON", "BTF", "tracefs", "uprobes", "kprobes", "kernel headers", "bcc (python3-bpfcc)"} <= names
    assert p.returncode == (0 if data["capture_available"] else 1)


def test_doctor_json_names_the_capabilities_this_process_lacks():
    import json

    from kvtrace.host import privileges

    data = json.loads(run_kvtrace("doctor", "--json").stdout)
    lacking = [c.name for c in privileges.missing()]   # the child inherits these capabilities
    assert [m["name"] for m in data["missing_capabilities"]] == lacking
    assert all(m["cost"] for m in data["missing_capabilities"])


def test_missing_capabilities_from_a_capability_mask():
    from kvtrace.doctor import checks
    from kvtrace.host import privileges

    bit = {c.name: 1 << c.number for c in privileges.CAPABILITIES}
    capture_only = checks.missing_capabilities(bit["CAP_BPF"] | bit["CAP_PERFMON"])
    assert [m["name"] for m in capture_only] == ["CAP_SYS_PTRACE", "CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE"]
    assert capture_only[0]["cost"].startswith("no live injection into vLLM (kernel probes, KV events and /metrics still run)")
    admin = {m["name"]: m["cost"] for m in checks.missing_capabilities(bit["CAP_SYS_ADMIN"])}
    assert "CAP_SYS_ADMIN is held" in admin["CAP_BPF"] and admin["CAP_SYS_PTRACE"] == privileges.BY_NAME["CAP_SYS_PTRACE"].cost
    assert privileges.capture_possible(bit["CAP_SYS_ADMIN"]) and not privileges.capture_possible(bit["CAP_BPF"])
    assert checks.missing_capabilities(sum(bit.values())) == []
