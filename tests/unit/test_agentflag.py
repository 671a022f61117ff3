"""The agent's flag as the hook judges it: alive while the agent holds its lock, gone once the
agent exits however it exits (SIGKILL included), whatever the pid means in the reader's pid
namespace; and put inside another filesystem root (a container's /dev/shm) on request."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvtrace.attach.agentflag import AgentFlag
from kvtrace.host.confined import UnsafePath
from kvtrace.hook import transport


def test_entry_is_alive_while_the_lock_is_held(tmp_path):
    d = str(tmp_path / "agents")
    with AgentFlag(d) as flag:
        entry = os.path.join(d, str(os.getpid()))
        assert open(entry).read() == f"{os.getpid()} lock\n"
        assert transport.agent_pids(d) == [os.getpid()] and transport.agent_alive(d)
        assert transport.owner_live(d, os.getpid()) and not transport.owner_live(d, os.getpid() + 1)
        assert oct(os.stat(d).st_mode & 0o777) == "0o755" and flag.held
    assert not os.path.exists(entry) and transport.agent_pids(d) == []
    assert not transport.owner_live(d, os.getpid())


def test_a_sigkilled_agent_is_gone_though_its_file_stays(tmp_path):
    d = str(tmp_path / "agents")
    code = ("import sys, time; from kvtrace.attach.agentflag import AgentFlag; AgentFlag(sys.argv[1]).__enter__(); "
            "print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, d], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert transport.agent_pids(d) == [p.pid] and transport.owner_live(d, p.pid)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
    assert os.path.exists(os.path.join(d, str(p.pid)))   # left behind ...
    assert transport.agent_pids(d) == [] and not transport.owner_live(d, p.pid)   # ... and judged gone


def test_lock_beats_the_pid_a_container_might_reuse(tmp_path):
    """An unlocked "PID lock" entry is gone even when that pid is alive here (in a container's
    pid namespace the agent's pid may be some other live process)."""
    d = tmp_path / "agents"
    d.mkdir()
    (d / str(os.getpid())).write_text(f"{os.getpid()} lock\n")
    assert transport.agent_pids(str(d)) == []
    # a plain entry (no lock word) is judged by its pid, as hand-written flags in tests are
    (d / str(os.getpid())).write_text(f"{os.getpid()}\n")
    assert transport.agent_pids(str(d)) == [os.getpid()]
    (d / "999999999").write_text("")
    assert transport.agent_pids(str(d)) == [os.getpid()]


def test_a_flag_file_names_one_pid(tmp_path):
    f = tmp_path / "flag"
    f.write_text(f"{os.getpid()}\n")
    assert transport.agent_pids(str(f)) == [os.getpid()] and transport.owner_live(str(f), os.getpid())
    f.write_text("garbage\n")
    assert transport.agent_pids(str(f)) == []


def test_add_root_flags_the_agent_inside_another_root_once(tmp_path):
    d = str(tmp_path / "host" / "shm" / "agents")
    (tmp_path / "host" / "shm").mkdir(parents=True)
    root = tmp_path / "ctr"
    (root / str(tmp_path / "host" / "shm").lstrip("/")).mkdir(parents=True)
    with AgentFlag(d) as flag:
        assert flag.add_root("/") is False                       # our own root: the flag is there
        assert flag.add_root(str(root)) is True
        assert flag.add_root(str(root)) is False                 # once per directory
        inside = str(root) + d
        assert transport.agent_pids(inside) == [os.getpid()]
        assert transport.owner_live(inside, os.getpid())
    assert transport.agent_pids(inside) == [] and not os.listdir(inside)


def test_checking_leaves_no_lock_behind(tmp_path):
    """The hook's check takes a shared lock only to test it and drops it at once."""
    import fcntl

    d = tmp_path / "agents"
    d.mkdir()
    entry = d / "12345"
    entry.write_text("12345 lock\n")           # stale: nobody holds it
    assert not transport.agent_alive(str(d))
    fd = os.open(entry, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # would raise if the check kept its lock
    finally:
        os.close(fd)


def test_a_new_agent_removes_the_entries_of_agents_gone(tmp_path):
    """SIGKILLed agents leave entries the hook would open at every re-check: the next agent
    removes them, and only them."""
    d = str(tmp_path / "agents")
    code = ("import sys, time; from kvtrace.attach.agentflag import AgentFlag; AgentFlag(sys.argv[1]).__enter__(); "
            "print('ready', flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code, d], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs[:2]:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        assert sorted(os.listdir(d)) == sorted(str(p.pid) for p in procs)
        with AgentFlag(d) as flag:
            assert flag.pruned == 2
            assert sorted(os.listdir(d)) == sorted([str(procs[2].pid), str(os.getpid())])
            assert transport.agent_pids(d) == sorted([procs[2].pid, os.getpid()])
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


# A hostile host: the flag directory and its entries are made or trusted only as root's, never
# through a link; what another user or a container planted is refused and left as it was.

def _snapshot(p) -> tuple:
    st = os.lstat(p)
    return st.st_mode, st.st_uid, st.st_gid, (open(p, "rb").read() if os.path.isfile(p) else sorted(os.listdir(p)))


def test_a_link_planted_at_the_flag_directory_is_refused(tmp_path):
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    os.chmod(secret, 0o700)
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "agents").symlink_to(secret)
    before = _snapshot(secret)
    with pytest.raises(UnsafePath, match=r"agents: not used, it is, or passes through, a symbolic link$"):
        AgentFlag(str(tmp_path / "shm" / "agents")).__enter__()
    assert _snapshot(secret) == before and oct(os.stat(secret).st_mode & 0o777) == "0o700"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a directory as another uid")
def test_a_flag_directory_another_user_made_is_refused_and_nothing_truncated(tmp_path):
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    os.chmod(victim, 0o600)
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    planted = shm / "agents"
    planted.mkdir()
    os.symlink(victim, planted / f".{os.getpid()}.tmp")      # the entry's temporary name, linked to a root file
    os.chown(planted, 65534, 65534)
    before = _snapshot(victim), _snapshot(planted)
    with pytest.raises(UnsafePath, match=r"agents: not used, it is owned by uid 65534, not by uid 0; remove it and try again$"):
        AgentFlag(str(planted)).__enter__()
    assert (_snapshot(victim), _snapshot(planted)) == before


def test_a_fifo_at_the_flag_directory_is_refused_without_blocking(tmp_path):
    (tmp_path / "shm").mkdir()
    os.mkfifo(tmp_path / "shm" / "agents")
    with pytest.raises(UnsafePath, match="agents: not used, a part of it is not a directory"):
        AgentFlag(str(tmp_path / "shm" / "agents")).__enter__()


def test_a_container_whose_dev_shm_links_to_the_host_is_not_flagged(tmp_path):
    """Through /proc/PID/root the container's absolute link would land in the host's tree."""
    host = tmp_path / "host-dir"
    host.mkdir(mode=0o700)
    os.chmod(host, 0o700)
    (tmp_path / "shm").mkdir()
    ctr = tmp_path / "ctr"
    (ctr / "dev").mkdir(parents=True)
    (ctr / "dev" / "shm").symlink_to(host)
    before = _snapshot(host)
    with AgentFlag(str(tmp_path / "shm" / "agents")) as flag:
        flag.dir = "/dev/shm/kvtrace-agents"          # the in-container path, as attach uses it
        with pytest.raises(UnsafePath, match=rf"^{ctr}/dev/shm: not used, it is, or passes through, a symbolic link$"):
            flag.add_root(str(ctr))
        assert len(flag.held) == 1
    assert _snapshot(host) == before and oct(os.stat(host).st_mode & 0o777) == "0o700"
