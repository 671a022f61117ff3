"""KV events only from the server's processes (kvtrace.servers.kvpeer, kvtrace.servers.kvrelay), without
root: where kvtrace listens (never a wildcard, a warning off loopback), a TCP port held by a
process that is not the server gets nothing, the relay changes nothing ZeroMQ sees (reconnects,
replays, restarts), and who counts as the server (children, a recycled pid, a restart)."""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from kvtrace.servers import kvpeer
from kvtrace.servers.kvevents import KvEventSubscriber, bind_address
from tests.helpers import free_port, wait_for
from tests.unit.test_kvevents_stream import FakePublisher, batch, connected, seqs


def listeners(port: int) -> set:
    return {local for local, _, state, _ in kvpeer.tcp_table() if state == kvpeer.LISTEN and local[1] == port}


def local_ip() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


@pytest.fixture
def sleeper():
    """A process that is not the test: the 'server' in tests where the test itself is the intruder."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_bind_address_never_a_wildcard():
    assert bind_address("tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", None)
    assert bind_address("tcp://localhost:5557") == ("tcp://127.0.0.1:5557", None)
    for ep, lo in (("tcp://0.0.0.0:5557", "127.0.0.1:5557"), ("tcp://*:5557", "127.0.0.1:5557"),
                   ("tcp://[::]:5557", "[::1]:5557")):
        addr, line = bind_address(ep)
        assert addr == f"tcp://{lo}" and f"kvtrace listens on {lo} only, never on a wildcard address" in line
    addr, line = bind_address("tcp://192.0.2.7:5557")
    assert addr == "tcp://192.0.2.7:5557" and "not loopback" in line and "only the server's own processes" in line


def test_a_wildcard_endpoint_is_bound_on_loopback_only():
    port = free_port(5600, 5699)
    sub = KvEventSubscriber(f"tcp://0.0.0.0:{port}", None, bind=True, peers=[os.getpid()])
    (line,) = sub.start()
    try:
        assert "never on a wildcard address" in line
        assert listeners(port) == {("127.0.0.1", port)}
        pub = FakePublisher(f"tcp://0.0.0.0:{port}", None, bind=False)   # as vLLM connects out to it
        assert connected(pub, sub)
        pub.close()
    finally:
        sub.stop()


def test_a_non_loopback_address_is_bound_exactly_with_one_warning():
    ip = local_ip()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    port = free_port(5600, 5699)
    sub = KvEventSubscriber(f"tcp://{ip}:{port}", None, bind=True, peers=[os.getpid()])
    (line,) = sub.start()
    sub.stop()
    assert line.startswith(f"KV events: kvtrace listens on {ip}:{port}, not loopback") and "\n" not in line
    assert "rejected_peers" in line


def _tcp_sink(lsock: socket.socket, got: dict, stop: threading.Event) -> None:
    """Accept whatever connects and count the bytes it sends."""
    lsock.settimeout(0.05)
    conns = []
    while not stop.is_set():
        try:
            c, _ = lsock.accept()
            c.setblocking(False)
            conns.append(c)
            got["connections"] += 1
        except socket.timeout:
            pass
        for c in conns:
            try:
                got["bytes"] += len(c.recv(65536))
            except BlockingIOError:
                pass
            except OSError:
                pass


def test_a_tcp_port_held_by_another_process_gets_nothing(sleeper):
    """Connect mode: the PUB port and the replay port are held by this test, not by the server
    (``sleeper``): kvtrace connects, sees whose the listener is, and closes without a byte."""
    got = {"connections": 0, "bytes": 0}
    stop = threading.Event()
    ports, threads = [], []
    for _ in range(2):
        lsock = socket.create_server(("127.0.0.1", free_port(5600, 5699)))
        ports.append(lsock.getsockname()[1])
        threads.append(threading.Thread(target=_tcp_sink, args=(lsock, got, stop), daemon=True))
        threads[-1].start()
    lines: list[str] = []
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", peers=[sleeper.pid],
                            echo=lines.append, resume_from=0, replay_timeout=0.5)
    sub.start()
    wait_for(lambda: sub.stats()["rejected_peers"] >= 4 or got["bytes"], 5)
    sub.stop()
    stop.set()
    for t in threads:
        t.join(5)
    st = sub.stats()
    assert got["connections"] >= 2 and got["bytes"] == 0, got
    assert st["batches"] == 0 and st["replay_failures"] >= 1
    assert len(lines) == 1 and "is held by a process that is not the server's" in lines[0], lines
    assert f"pid {sleeper.pid}" in lines[0] and "\n" not in lines[0]


def _restart_scenario(eps, peers) -> dict:
    pub = FakePublisher(*eps, start_seq=50)
    sub = KvEventSubscriber(eps[0], eps[1], peers=peers)
    sub.start()
    got = connected(pub, sub)
    for i in range(5):
        pub.publish(batch(i), drop=i == 2)    # a gap, filled by replay
    pub.flush()
    assert wait_for(lambda: sub.stats()["last_seq"] == got[0] + len(got) + 4)
    assert len(seqs(sub)) == 5
    pub.close()
    assert wait_for(lambda: sub.stats()["disconnects"] == 1)
    time.sleep(0.5)   # nobody at the endpoint: ZeroMQ retries, nothing counted
    pub2 = FakePublisher(*eps, start_seq=0)   # a new server: seq from 0
    connected(pub2, sub)
    sub.stop()
    pub2.close()
    return sub.stats()


KEYS = ("connects", "disconnects", "publisher_restarts", "gaps", "gap_batches", "missing", "duplicates",
        "replay_requests", "replay_failures", "bad_frames", "internal_errors", "rejected_peers")


def test_the_relay_changes_nothing_zeromq_sees(tmp_path):
    """The same reconnect, gap, replay and publisher restart, without and with the relay."""
    direct = _restart_scenario((f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/ar.sock"), None)
    relayed = _restart_scenario((f"ipc://{tmp_path}/b.sock", f"ipc://{tmp_path}/br.sock"), [os.getpid()])
    assert {k: relayed[k] for k in KEYS} == {k: direct[k] for k in KEYS}
    assert relayed["publisher_restarts"] == 1 and relayed["connects"] == 2 and relayed["replayed"] >= 1
    assert relayed["peer_check"] and not direct["peer_check"]


def test_bind_mode_through_the_relay_takes_the_server_connecting_out():
    ep = f"tcp://127.0.0.1:{free_port(5600, 5699)}"
    sub = KvEventSubscriber(ep, None, bind=True, peers=[os.getpid()])
    assert sub.start() == []
    pub = FakePublisher(ep, None, bind=False)
    got = connected(pub, sub)
    for i in range(3):
        pub.publish(batch(i))
    pub.flush()
    assert wait_for(lambda: sub.stats()["batches"] == len(got) + 3)
    sub.stop()
    pub.close()
    got += seqs(sub)
    assert got == list(range(got[0], got[0] + len(got)))
    assert sub.bind and sub.stats()["rejected_peers"] == 0 and sub.stats()["connects"] == 1


def test_server_procs_are_its_descendants_and_not_a_recycled_pid():
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        child = wait_for(lambda: psutil.Process(parent.pid).children(), 10, "the child")[0].pid
        procs = kvpeer.ServerProcs([parent.pid], refresh_s=60)
        now = time.monotonic()
        assert procs.owns_pid(parent.pid, now) and procs.owns_pid(child, now) and not procs.owns_pid(os.getpid(), now)
        procs._snap[1][os.getpid()] = 0.0   # a pid remembered from a process that is gone
        assert not procs.owns_pid(os.getpid(), now)
        with pytest.raises(kvpeer.Undecided):   # read before it was seen, too recently to read again
            procs.owns_pid(os.getpid(), time.monotonic())
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_server_roots_follow_a_restart_on_the_same_port(monkeypatch):
    old = subprocess.Popen(["sleep", "60"])
    new = subprocess.Popen(["sleep", "60"])
    try:
        server = SimpleNamespace(pid=old.pid, port=8123, netns_id="net:[1]")
        roots = kvpeer.server_roots(server, every_s=0)
        assert roots() == [old.pid]
        old.kill()
        old.wait()
        from kvtrace.servers import discover

        others = [SimpleNamespace(pid=1, port=9999, netns_id="net:[1]"),
                  SimpleNamespace(pid=new.pid, port=8123, netns_id="net:[1]")]
        monkeypatch.setattr(discover, "discover", lambda: others)
        assert roots() == [new.pid]
        monkeypatch.setattr(discover, "discover", lambda: [])
        assert roots() == [new.pid]   # kept while it runs
    finally:
        for p in (old, new):
            p.kill()
            p.wait()


def test_the_server_connecting_just_after_a_refusal_is_not_refused():
    """The server's processes were just read (to refuse another process); the server connects
    right after, too soon to read them again: it waits, unread, and is taken, not refused."""
    ep = f"tcp://127.0.0.1:{free_port(5600, 5699)}"
    sub = KvEventSubscriber(ep, None, bind=True, peers=kvpeer.ServerProcs([os.getpid()], refresh_s=1.0))
    assert sub.start() == []
    host, port = ep[len("tcp://"):].split(":")
    # an orphan (sh exits at once): not this process's descendant
    code = f"import socket, time; s = socket.create_connection(('{host}', {port})); time.sleep(0.3)"
    subprocess.run(["sh", "-c", f"{sys.executable} -c \"{code}\" &"], check=True, timeout=30)
    wait_for(lambda: sub.stats()["rejected_peers"] == 1, 10, "the other process refused")
    pub = FakePublisher(ep, None, bind=False)   # this process: the server
    assert connected(pub, sub)
    sub.stop()
    pub.close()
    assert sub.stats()["rejected_peers"] == 1 and sub.stats()["connects"] == 1


@pytest.mark.parametrize("openat2", [True, False])
def test_an_ipc_path_resolves_inside_the_root_only(tmp_path, monkeypatch, openat2):
    """openat2 RESOLVE_IN_ROOT (or, on a kernel without it, no symlink at all): a symlink planted
    in the root never leads outside it, and the socket itself must be no symlink."""
    if not openat2:
        def enosys(*args) -> int:
            ctypes.set_errno(errno.ENOSYS)
            return -1
        monkeypatch.setattr(kvpeer, "_libc", SimpleNamespace(syscall=enosys))
    root, host = tmp_path / "root", tmp_path / "host"
    (root / "run").mkdir(parents=True)
    host.mkdir()
    socks = []
    for where in (root / "run", host):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(where / "kv.sock"))
        socks.append(s)
    os.close(kvpeer._socket_fd(str(root), "/run/kv.sock"))   # the real thing
    (root / "link.sock").symlink_to(host / "kv.sock")
    with pytest.raises(kvpeer.Refused, match="it is a symlink, not the server's socket"):
        kvpeer._socket_fd(str(root), "/link.sock")
    (root / "up").symlink_to(host)    # a directory leading out: inside the root it is /host, absent
    with pytest.raises(OSError):
        kvpeer._socket_fd(str(root), "/up/kv.sock")
    for s in socks:
        s.close()


def test_attach_streams_take_kv_events_only_from_known_processes():
    """kvtrace attach's streams: with a server, its processes; with only traced pids, those;
    with neither, an endpoint the server connects out to is not listened on (one line)."""
    from kvtrace.attach.streams import start_vllm_streams
    from kvtrace.servers import info as server_info

    ep = f"tcp://127.0.0.1:{free_port(5600, 5699)}"
    lines: list[str] = []
    assert start_vllm_streams(None, ep, None, None, 1.0, echo=lines.append) == []
    assert lines == [f"kvtrace: warning: the server connects out to the KV events endpoint {ep}, but kvtrace knows no "
                     "server process to take events from (attach with --port or --pid of the server); capture "
                     "continues without kv_events"]
    kv = server_info.KvEventsInfo(enabled=True, publisher="zmq", endpoint=ep.replace("127.0.0.1", "0.0.0.0"),
                        replay_endpoint=None)
    server = server_info.ServerInfo(pid=os.getpid(), api_pids=[os.getpid()], engine_pids=[], worker_pids=[], other_pids=[],
                              host="127.0.0.1", port=None, model="m", python_exe=None, python_version=None,
                              version=None, site_packages=None, plugin="absent", kv_events=kv,
                              in_container=False, cmdline=["vllm", "serve", "m"], kind="vllm")
    for args in ((None, ep, None, None, 1.0), (server, None, None, None, 1.0)):
        lines.clear()
        (sub,) = start_vllm_streams(*args, echo=lines.append, pids=[os.getpid()])
        sub.close()
        assert sub.stats()["peer_check"] and sub.bind and sub.endpoint == ep
        name = "vLLM " if args[0] is not None else ""   # the server's kind, when kvtrace knows the server
        assert lines[-1] == f"kvtrace: {name}streams: kv_events from {ep} (bound: vLLM connects to it)"
    assert lines[0].startswith("kvtrace: warning: KV events: the server connects out to 0.0.0.0:")   # the wildcard
