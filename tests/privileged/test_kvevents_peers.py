"""KV events only from the server's own processes, against real processes: a forged publisher
running as another user connects to the address kvtrace bound (refused, counted, its events
never land), and a container whose ipc path is a symlink to a host socket (kvtrace never
connects to it).  The server is a stand-in process (tests/privileged/kvpub.py), no vLLM."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.servers.kvevents import KvEventSubscriber, subscriber_endpoint
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.root

KVPUB = str(Path(__file__).with_name("kvpub.py"))
SERVER_HASH, FORGED_HASH = 1_000_000, 666_000
NOBODY = 65534


def others_can_run_python() -> None:
    """Skip, saying why, when another user cannot run this venv's Python and kvpub.py (a checkout
    in a directory only root may enter)."""
    for path, need in ((sys.executable, stat.S_IXOTH), (KVPUB, stat.S_IROTH)):
        p = os.path.realpath(path)
        while p != "/":
            if not os.stat(p).st_mode & need:
                pytest.skip(f"another user cannot use {path} (no permission on {p}): clone and set up "
                            "kvtrace where other users can enter to run the forged publisher")
            p, need = os.path.dirname(p), stat.S_IXOTH


def kvpub(user: int | None = None, **args) -> subprocess.Popen:
    """A stand-in publisher process (kvpub.py), as ``user`` when given."""
    if user is not None:
        others_can_run_python()
    ids = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    return subprocess.Popen([sys.executable, KVPUB, json.dumps(args)], cwd="/", stdout=subprocess.PIPE, text=True,
                            start_new_session=True, **ids)


def stop(*procs) -> None:
    """Kill each process and its children (a kvpub with ``child``)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def test_a_forged_publisher_is_refused_and_only_the_servers_events_land():
    """vLLM connects out (tcp://127.0.0.1:P): kvtrace binds P.  A process of another user connects
    first and publishes BlockStored batches seq 0..4 again and again; the server (whose
    publisher is its child, as EngineCore is the API server's) connects 1.5 s later from seq 100."""
    ep = f"tcp://127.0.0.1:{free_port(5600, 5699)}"
    server = kvpub(endpoint=ep, first=100, hash=SERVER_HASH, every=0.05, seconds=8, delay=1.5, child=True)
    forged = kvpub(NOBODY, endpoint=ep, first=0, hash=FORGED_HASH, every=0.02, seconds=4, wrap=5)
    lines: list[str] = []
    sub = KvEventSubscriber(ep, None, bind=True, peers=[server.pid], echo=lines.append)
    try:
        assert sub.start() == []
        forged.wait(30)
        wait_for(lambda: sub.stats()["batches"] >= 30, 30, "30 batches")
    finally:
        sub.stop()
        stop(server, forged)
    assert int(forged.stdout.read()) > 100   # it did publish
    st, t = sub.stats(), sub.drain()["kv_events"]
    hashes, seqs = t.column("block_hash").to_pylist(), t.column("seq").to_pylist()
    assert min(hashes) >= SERVER_HASH, "a forged event landed in kv_events"
    assert st["first_seq"] == min(seqs) >= 100 and seqs == list(range(st["first_seq"], st["first_seq"] + len(seqs)))
    assert st["publisher_restarts"] == 0 and st["missing"] == 0 and st["gaps"] == 0
    assert st["rejected_peers"] >= 1 and st["peer_check"] and st["connects"] == 1 and st["disconnects"] == 0
    assert len(lines) == 1 and "KV events: refused a connection to 127.0.0.1:" in lines[0]
    assert "not from the server's processes" in lines[0] and "\n" not in lines[0], lines
    print(f"\n[kvpeer] {len(seqs)} server batches from seq {st['first_seq']}; forged connections refused: "
          f"{st['rejected_peers']}; {lines[0]}")


def chrooted(root: Path) -> int:
    """A process whose root is ``root``: a container's /proc/PID/root as kvtrace sees it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.chroot(root)
            os.chdir("/")
            time.sleep(60)
        finally:
            os._exit(0)
    return pid


@pytest.mark.parametrize("planted", ["socket", "parent directory"])
def test_a_planted_ipc_symlink_is_never_connected(tmp_path, planted):
    """The server's ipc path (ipc:///run/kv.sock inside its root) is a symlink the container
    planted, to a host socket (kv.sock itself, or its directory /run): the host socket sees no
    connection and no byte."""
    host = tmp_path / "host"
    host.mkdir()
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(str(host / "kv.sock"))
    daemon.listen(8)
    daemon.setblocking(False)
    root = tmp_path / "container"
    (root / "run").mkdir(parents=True) if planted == "socket" else root.mkdir()
    if planted == "socket":
        (root / "run" / "kv.sock").symlink_to(host / "kv.sock")
    else:
        (root / "run").symlink_to(host)
    pid = chrooted(root)
    lines: list[str] = []
    try:
        address, bind = subscriber_endpoint("ipc:///run/kv.sock", root=f"/proc/{pid}/root")
        assert address == f"ipc:///proc/{pid}/root/run/kv.sock" and not bind
        sub = KvEventSubscriber(address, address, peers=[pid], echo=lines.append, resume_from=0, replay_timeout=0.3)
        sub.start()
        time.sleep(1.5)
        sub.stop()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    with pytest.raises(BlockingIOError):
        daemon.accept()   # nobody ever connected to the host socket
    daemon.close()
    if planted == "socket":
        assert sub.stats()["rejected_peers"] >= 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"KV events: refused ipc:///run/kv.sock inside /proc/{pid}/root: it is a symlink, "
                                   "not the server's socket; kvtrace does not connect to it")
        print(f"\n[kvpeer] {lines[0]}")
    assert sub.stats()["batches"] == 0


def test_an_ipc_socket_of_another_process_gets_nothing(tmp_path):
    """The path is a real socket, but held by a process that is not the server: SO_PEERCRED
    says so before kvtrace writes a byte."""
    intruder = socket.socket(socket.AF_UNIX)
    intruder.bind(str(tmp_path / "kv.sock"))
    intruder.listen(8)
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    lines: list[str] = []
    try:
        sub = KvEventSubscriber(f"ipc://{tmp_path}/kv.sock", None, peers=[server.pid], echo=lines.append)
        sub.start()
        wait_for(lambda: sub.stats()["rejected_peers"] >= 2, 5)
        sub.stop()
    finally:
        stop(server)
    intruder.setblocking(False)
    received = 0
    while True:
        try:
            conn, _ = intruder.accept()
        except BlockingIOError:
            break
        conn.settimeout(1)
        try:
            received += len(conn.recv(4096))
        except OSError:
            pass
    assert received == 0
    assert len(lines) == 1 and f"it belongs to pid {os.getpid()}, not the server's processes" in lines[0], lines


def test_the_server_itself_over_ipc_and_tcp_with_replay(tmp_path):
    """The positive side: a server binding its PUB and replay ROUTER (ipc, then tcp) is reached,
    checked and replayed from, through the relay."""
    for ep, replay in ((f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock"),
                       (f"tcp://127.0.0.1:{free_port(5600, 5699)}", f"tcp://127.0.0.1:{free_port(5600, 5699)}")):
        server = kvpub(endpoint=ep, bind=True, replay=replay, first=0, hash=SERVER_HASH, every=0.02, seconds=30,
                       child=True)
        try:
            time.sleep(1.0)   # some batches published before kvtrace comes: replay brings them
            sub = KvEventSubscriber(ep, replay, peers=[server.pid], resume_from=0)
            assert sub.start() == []
            wait_for(lambda: sub.stats()["batches"] >= 60, 30, "60 batches")
            sub.stop()
        finally:
            stop(server)
        st = sub.stats()
        seqs = sub.drain()["kv_events"].column("seq").to_pylist()
        assert seqs == list(range(len(seqs))) and st["replayed"] >= 5, (ep, st)
        assert st["rejected_peers"] == 0 and st["missing"] == 0 and st["disconnects"] == 0


def test_in_the_servers_network_namespace_a_forged_publisher_there_is_refused():
    """The server in a network namespace of its own connects out to its own loopback: kvtrace
    binds there (its thread entered the namespace) and tells the server's connection from a
    forged one made inside the same namespace by another user."""
    others_can_run_python()
    port = free_port(5600, 5699)
    ep = f"tcp://127.0.0.1:{port}"
    args = json.dumps({"endpoint": ep, "first": 100, "hash": SERVER_HASH, "every": 0.05, "seconds": 8, "delay": 1.5})
    script = f"ip link set lo up && exec {sys.executable} {KVPUB} '{args}'"
    server = subprocess.Popen(["unshare", "--net", "sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE,
                              text=True)
    ns = f"/proc/{server.pid}/ns/net"
    wait_for(lambda: os.readlink(ns) != os.readlink("/proc/self/ns/net"), 10, "the server's own namespace")
    forged_args = json.dumps({"endpoint": ep, "first": 0, "hash": FORGED_HASH, "every": 0.02, "seconds": 4, "wrap": 5})
    forged = subprocess.Popen(["nsenter", f"--net={ns}", "--setuid", str(NOBODY), "--setgid", str(NOBODY),
                               sys.executable, KVPUB, forged_args], cwd="/", start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    sub = KvEventSubscriber(ep, None, bind=True, peers=[server.pid], netns=ns)
    try:
        assert sub.start() == []
        forged.wait(30)
        wait_for(lambda: sub.stats()["batches"] >= 30, 30, "30 batches")
    finally:
        sub.stop()
        stop(server, forged)
    assert int(forged.stdout.read()) > 100
    st, t = sub.stats(), sub.drain()["kv_events"]
    assert min(t.column("block_hash").to_pylist()) >= SERVER_HASH
    assert st["rejected_peers"] >= 1 and st["first_seq"] >= 100 and st["publisher_restarts"] == 0
