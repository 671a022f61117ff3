"""The network side of the KV-event subscriber, where every peer is checked before a byte passes.

kvtrace's ZeroMQ sockets (SUB, and the replay DEALER) only ever talk to private ipc endpoints
in a fresh 0700 directory; one relay thread owns the real endpoints with plain non-blocking
sockets and copies bytes between the two (ZMTP frames ipc and tcp alike):

- ``listen`` (vLLM connects out): a TCP listener on exactly the endpoint's address; each
  accepted connection whose peer socket is not held by the server's processes is closed at
  once and counted; an accepted one is linked to a fresh connection to the private endpoint
  that SUB binds.
- ``dial`` (vLLM binds): one connection to the real endpoint, checked (the TCP listener's
  owner, or SO_PEERCRED and a no-symlink path for ipc) before anything is written, is held
  ready; only then the private endpoint listens for SUB or DEALER to take it, so ZeroMQ sees
  what it would see without the relay: a refused connect until the server is there, a
  disconnect when it goes, a connect when it is back.

Buffers are bounded (``BUF`` per direction: a full one stops reading that side), the thread
never blocks (a selector, 100 ms ticks) and it stops with the subscriber.
"""
from __future__ import annotations

import errno
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time

from kvtrace.servers import kvpeer
from kvtrace.servers.kvendpoints import tcp_hostport

BUF = 1 << 20
RETRY_S, RETRY_MAX_S = 0.1, 2.0
RECHECK_S = 0.05   # a peer not identified yet is asked about again this often
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class Relay:
    """One thread and one selector for a subscriber's endpoints; ``on_reject(line)`` is called
    (from the relay thread) for every peer refused."""

    def __init__(self, procs: kvpeer.ServerProcs, on_reject=None):
        self.procs = procs
        self.on_reject = on_reject or (lambda line: None)
        self.errors = 0
        self.dir = tempfile.mkdtemp(prefix="kvtrace-kv-")  # 0700: nobody else can reach its sockets
        self.sel = selectors.DefaultSelector()
        self.parts: list = []      # Inbound / Outbound
        self.links: set = set()    # Pipe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _private(self) -> str:
        return os.path.join(self.dir, f"{len(self.parts)}.sock")

    def listen(self, endpoint: str) -> str:
        """Listen on the tcp ``endpoint``'s exact address (OSError if it cannot); the private
        endpoint for SUB to bind."""
        path = self._private()
        self.parts.append(Inbound(self, _listener(endpoint), path))
        return "ipc://" + path

    def dial(self, endpoint: str) -> str:
        """Reach the tcp/ipc ``endpoint`` that the server binds; the private endpoint to connect to."""
        path = self._private()
        self.parts.append(Outbound(self, endpoint, path))
        return "ipc://" + path

    def start(self) -> None:
        """Start the thread (it inherits the caller's network namespace), after a first round here."""
        for part in self.parts:
            part.tick(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="kvtrace-kvrelay", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for link in list(self.links):
            link.close()
        for part in self.parts:
            part.close()
        self.sel.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def reject(self, why: str) -> None:
        self.on_reject(why)

    def watch(self, sock: socket.socket, mask: int, cb=None) -> None:
        """Register, change or (mask 0) drop ``sock`` in the selector."""
        if sock.fileno() < 0:
            return
        try:
            self.sel.get_key(sock)
            known = True
        except KeyError:
            known = False
        if not mask:
            if known:
                self.sel.unregister(sock)
        elif known:
            self.sel.modify(sock, mask, cb)
        else:
            self.sel.register(sock, mask, cb)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for key, mask in self.sel.select(0.1):
                    key.data(mask)
                now = time.monotonic()
                for part in self.parts:
                    part.tick(now)
            except Exception:
                self.errors += 1
                time.sleep(0.05)


class Pipe:
    """Bytes both ways between two connected sockets, at most ``BUF`` waiting per direction."""

    def __init__(self, relay: Relay, a: socket.socket, b: socket.socket, pending: bytes = b"", on_close=None):
        self.relay, self.on_close, self.closed = relay, on_close, False
        self.peer = {a: b, b: a}
        self.out = {a: bytearray(pending), b: bytearray()}   # bytes still to write to that socket
        self.cb = {s: (lambda mask, s=s: self._on(s, mask)) for s in (a, b)}
        relay.links.add(self)
        self._flush(a)
        self._update()

    def _update(self) -> None:
        if self.closed:
            return
        for s, other in self.peer.items():
            mask = (READ if len(self.out[other]) < BUF else 0) | (WRITE if self.out[s] else 0)
            self.relay.watch(s, mask, self.cb[s])

    def _on(self, s: socket.socket, mask: int) -> None:
        if mask & WRITE:
            self._flush(s)
        if mask & READ and not self.closed:
            try:
                data = s.recv(65536)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":   # that side is gone: what it sent still goes on, then both close
                self._flush(self.peer[s])
                self.close()
                return
            if data:
                self.out[self.peer[s]] += data
                self._flush(self.peer[s])
        self._update()

    def _flush(self, s: socket.socket) -> None:
        buf = self.out[s]
        if not buf or self.closed:
            return
        try:
            del buf[:s.send(buf)]
        except BlockingIOError:
            pass
        except OSError:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in self.peer:
            self.relay.watch(s, 0)
            s.close()
        self.relay.links.discard(self)
        if self.on_close is not None:
            self.on_close()


class Inbound:
    """Bind mode: accept, check the peer, link it to the private endpoint SUB binds.  A peer
    not known yet waits, unread, for a later tick (at most ``WAITING`` of them)."""

    WAITING = 64

    def __init__(self, relay: Relay, lsock: socket.socket, path: str):
        self.relay, self.lsock, self.path = relay, lsock, path
        self.waiting: list[tuple[socket.socket, tuple, float]] = []   # (conn, peer address, accepted at)
        self.recheck_at = 0.0
        relay.watch(lsock, READ, self._on)

    def tick(self, now: float) -> None:
        if not self.waiting or now < self.recheck_at:
            return
        self.recheck_at = now + RECHECK_S
        waiting, self.waiting = self.waiting, []
        for conn, addr, since in waiting:
            self._decide(conn, addr, since)

    def _on(self, mask: int) -> None:
        for _ in range(16):
            try:
                conn, addr = self.lsock.accept()
            except OSError:   # nothing more waiting (or no fd left: the next tick tries again)
                return
            conn.setblocking(False)
            self._decide(conn, addr, time.monotonic())

    def _decide(self, conn: socket.socket, addr: tuple, since: float) -> None:
        try:
            kvpeer.check_inbound(conn, self.relay.procs, since)
        except kvpeer.Undecided:
            if len(self.waiting) < self.WAITING:
                self.waiting.append((conn, addr, since))
                return
            why = "too many connections waiting to be identified"
        except kvpeer.Refused as e:
            why = str(e)
        except OSError:
            why = "it closed before it could be identified"
        else:
            return self._link(conn)
        _abort(conn)
        self.relay.reject(why if why.startswith("KV events:") else
                          f"KV events: refused a connection from {kvpeer.fmt(kvpeer.norm(addr))}: {why}")

    def _link(self, conn: socket.socket) -> None:
        sub = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sub.connect(self.path)
        except OSError:
            sub.close()
            conn.close()
            return
        Pipe(self.relay, conn, sub)

    def close(self) -> None:
        self.relay.watch(self.lsock, 0)
        self.lsock.close()
        for conn, _, _ in self.waiting:
            conn.close()
        self.waiting = []


class Outbound:
    """Connect mode: one checked connection to the real endpoint held ready, offered on the
    private path while ready; linked to whatever takes it there."""

    def __init__(self, relay: Relay, endpoint: str, path: str):
        self.relay, self.endpoint, self.path = relay, endpoint, path
        self.up: socket.socket | None = None
        self.lsock: socket.socket | None = None
        self.early = bytearray()    # what the server sent before the private side was taken
        self.state, self.retry_at, self.backoff, self.since = "idle", 0.0, RETRY_S, 0.0

    def tick(self, now: float) -> None:
        if self.state == "idle" and now >= self.retry_at:
            self._dial()
        elif self.state == "checking" and now >= self.retry_at:
            self._check()

    def _dial(self) -> None:
        try:
            if self.endpoint.startswith("ipc://"):
                self.up = kvpeer.connect_unix(self.endpoint[len("ipc://"):])
                return self._connected()
            family, addr = _resolve(self.endpoint)
            self.up = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            rc = self.up.connect_ex(addr)
            if rc not in (0, errno.EINPROGRESS):
                return self._retry()
            self.state = "connecting"
            self.relay.watch(self.up, WRITE, self._on_connect)
        except kvpeer.Refused as e:
            self._refuse(e)
        except OSError:
            self._retry()

    def _on_connect(self, mask: int) -> None:
        if self.up is None:   # dropped earlier in the same round
            return
        if self.up.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return self._retry()
        self.relay.watch(self.up, 0)
        self._connected()

    def _connected(self) -> None:
        self.state, self.since = "checking", time.monotonic()
        self._check()

    def _check(self) -> None:
        """Whose the endpoint is, before a byte is written to it (or read from it)."""
        try:
            if self.endpoint.startswith("ipc://"):
                kvpeer.check_unix(self.up, self.endpoint[len("ipc://"):], self.relay.procs, self.since)
            else:
                kvpeer.check_listener(self.up, self.relay.procs, self.since)
        except kvpeer.Undecided:
            self.retry_at = time.monotonic() + RECHECK_S
            return
        except kvpeer.Refused as e:
            return self._refuse(e)
        except OSError:
            return self._retry()
        try:
            self._ready()
        except OSError:
            self._retry()

    def _ready(self) -> None:
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.lsock.bind(self.path)
        self.lsock.listen(1)
        self.state, self.backoff = "ready", RETRY_S
        self.relay.watch(self.lsock, READ, self._on_accept)
        self.relay.watch(self.up, READ, self._on_early)

    def _on_early(self, mask: int) -> None:
        if self.up is None:
            return
        try:
            data = self.up.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data or len(self.early) + len(data) > BUF:
            return self._retry()
        self.early += data

    def _on_accept(self, mask: int) -> None:
        if self.lsock is None or self.up is None:
            return
        try:
            down, _ = self.lsock.accept()
        except OSError:
            return
        down.setblocking(False)
        self._unlisten()
        self.relay.watch(self.up, 0)
        up, early, self.up, self.early = self.up, bytes(self.early), None, bytearray()
        self.state = "linked"
        Pipe(self.relay, down, up, pending=early, on_close=self._unlinked)

    def _unlinked(self) -> None:
        if self.state == "linked":
            self.state, self.retry_at = "idle", 0.0

    def _retry(self, delay: float = RETRY_S) -> None:
        self.close()
        self.state, self.retry_at = "idle", time.monotonic() + delay

    def _refuse(self, e: Exception) -> None:
        if self.up is not None:
            self.relay.watch(self.up, 0)
            _abort(self.up)   # never a byte written to it
            self.up = None
        self.relay.reject(str(e))
        self._retry(self.backoff)
        self.backoff = min(self.backoff * 2, RETRY_MAX_S)

    def _unlisten(self) -> None:
        if self.lsock is not None:
            self.relay.watch(self.lsock, 0)
            self.lsock.close()
            self.lsock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._unlisten()
        if self.up is not None:
            self.relay.watch(self.up, 0)
            self.up.close()
            self.up = None
        self.early = bytearray()


def _resolve(endpoint: str) -> tuple[int, tuple]:
    hp = tcp_hostport(endpoint)
    if hp is None:
        raise OSError(errno.EINVAL, f"cannot parse {endpoint}")
    family = socket.AF_INET6 if ":" in hp[0] else socket.AF_INET   # ZeroMQ's default: IPv4 unless a v6 literal
    family, _, _, _, addr = socket.getaddrinfo(hp[0], hp[1], family, socket.SOCK_STREAM)[0]
    return family, addr


def _listener(endpoint: str) -> socket.socket:
    family, addr = _resolve(endpoint)
    s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as ZeroMQ: a TIME_WAIT is no conflict
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(addr)
        s.listen(64)
        s.setblocking(False)
        return s
    except BaseException:
        s.close()
        raise


def _abort(s: socket.socket) -> None:
    """Close with a reset: the refused peer gets nothing, not even an orderly close."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()
