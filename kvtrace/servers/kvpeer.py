"""Who is at the other end of a KV-event connection: the server's own processes, or someone else.

kvtrace (root) accepts KV events only from the server: the API server's pid (or, after a restart
that ``--on-restart follow`` traces, the server now on the same port) and its descendants, which
hold vLLM's EngineCore and DP engines and SGLang's scheduler.  A TCP peer is known by its socket's
inode in ``/proc/thread-self/net/tcp{,6}`` (the calling thread's network namespace), looked up
among the ``socket:[inode]`` fds of those processes; a unix-socket peer by ``SO_PEERCRED``.
An ipc path is opened without leaving the server's root (``openat2`` ``RESOLVE_IN_ROOT`` from
``/proc/PID/root``) and must be a socket itself, not a symlink to one elsewhere.
"""
from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import re
import socket
import stat
import struct
import time

import psutil

from kvtrace.servers.procfs import _hex_addr, _socket_inodes, tcp_rows

LISTEN = "0A"
_ROOTED = re.compile(r"^(/proc/\d+/root)(/.*)$")
_libc = ctypes.CDLL(None, use_errno=True)
SYS_OPENAT2, RESOLVE_NO_MAGICLINKS, RESOLVE_IN_ROOT = 437, 0x02, 0x10


class Refused(Exception):
    """The peer is not the server's: one line saying why."""


class Undecided(Exception):
    """Not known yet: the server's processes were read too recently to read them again; ask
    again on a later tick (nothing is read from or written to the peer meanwhile)."""


class ServerProcs:
    """The server's processes (``roots()`` and their descendants) and the sockets they hold.

    A socket or pid that is not among them is an answer only if they were read after it was
    known to exist (``since``); else they are read again, at most every ``refresh_s`` (a flood
    of foreign connections costs a few /proc scans a second), and until then it is Undecided.
    Shared by several relay threads: each reading is one snapshot, replaced whole.
    """

    def __init__(self, roots, refresh_s: float = 0.2):
        self._roots = roots if callable(roots) else (lambda r=tuple(roots): r)
        self.refresh_s = refresh_s
        # (when the reading began, {pid: create time} (a recycled pid is not the server's), socket inodes)
        self._snap: tuple[float, dict[int, float], frozenset[str]] = (float("-inf"), {}, frozenset())

    def describe(self) -> str:
        roots = list(self._roots())
        return f"pid {', '.join(map(str, roots))} and its children" if roots else "no server process"

    def _read(self) -> tuple[float, dict[int, float], frozenset[str]]:
        began, pids = time.monotonic(), {}
        for root in self._roots():
            try:
                procs = [psutil.Process(root)]
                procs += procs[0].children(recursive=True)
            except psutil.Error:
                continue
            for p in procs:
                try:
                    pids[p.pid] = p.create_time()
                except psutil.Error:
                    pass
        return began, pids, frozenset(i for pid in pids for i in _socket_inodes(pid))

    def _owns(self, hit, since: float) -> bool:
        snap = self._snap
        if hit(*snap[1:]):
            return True
        if snap[0] < since:
            if time.monotonic() - snap[0] < self.refresh_s:
                raise Undecided()
            snap = self._snap = self._read()
        return hit(*snap[1:])

    def owns_inode(self, inode: str, since: float) -> bool:
        """Whether a socket that existed at ``since`` (monotonic) is held by the server's processes."""
        return inode != "0" and self._owns(lambda pids, inodes: inode in inodes, since)

    def owns_pid(self, pid: int, since: float) -> bool:
        """Whether a process that existed at ``since`` is one of the server's."""
        def hit(pids: dict[int, float], inodes) -> bool:
            try:
                return pid in pids and psutil.Process(pid).create_time() == pids[pid]
            except psutil.Error:
                return False
        return pid > 0 and self._owns(hit, since)


# --- TCP ----------------------------------------------------------------------------------------

def norm(addr) -> tuple[str, int]:
    """(ip, port) of a socket address, an IPv4-mapped IPv6 address as IPv4 (as _hex_addr does)."""
    ip = ipaddress.ip_address(addr[0].split("%")[0])
    return str(getattr(ip, "ipv4_mapped", None) or ip), addr[1]


def tcp_table():
    """(local, remote, state, inode) of every TCP socket in the calling thread's network namespace."""
    for c in tcp_rows("/proc/thread-self/net"):
        yield _hex_addr(c[1]), _hex_addr(c[2]), c[3], c[9]


def check_inbound(conn: socket.socket, procs: ServerProcs, since: float) -> None:
    """Refused unless the process that connected to us (before ``since``) holds its end in the
    server; Undecided when that cannot be known yet."""
    theirs, ours = norm(conn.getpeername()), norm(conn.getsockname())
    for local, remote, state, inode in tcp_table():
        if local == theirs and remote == ours and state != LISTEN and inode != "0":   # 0: closed (TIME_WAIT)
            if procs.owns_inode(inode, since):
                return
            break
    raise Refused(f"KV events: refused a connection to {fmt(ours)} from {fmt(theirs)}: not from the server's "
                  f"processes ({procs.describe()})")


def check_listener(conn: socket.socket, procs: ServerProcs, since: float) -> None:
    """Refused unless every socket listening where ``conn`` connected (before ``since``) belongs
    to the server; Undecided when that cannot be known yet."""
    ip, port = norm(conn.getpeername())
    wild = ("0.0.0.0", "::") if ipaddress.ip_address(ip).version == 4 else ("::",)
    owners = [inode for local, _, state, inode in tcp_table()
              if state == LISTEN and local[1] == port and local[0] in (ip, *wild)]
    if not owners:   # it went away, or a TCP self-connect: nobody to refuse, try again
        raise ConnectionRefusedError(f"nothing listens on {fmt((ip, port))}")
    if not all([procs.owns_inode(i, since) for i in owners]):
        raise Refused(f"KV events: refused {fmt((ip, port))}: it is held by a process that is not the server's "
                      f"({procs.describe()}); nothing was sent to it")


def fmt(addr: tuple[str, int]) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"


# --- unix sockets (ipc://) ----------------------------------------------------------------------

class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def split_root(path: str) -> tuple[str | None, str]:
    """(``/proc/PID/root`` or None, the path inside it) of an ipc path as subscriber_endpoint made it."""
    hit = _ROOTED.match(path)
    return (hit.group(1), hit.group(2)) if hit else (None, path)


def _open_dir(base: int, rel: str, in_root: bool) -> int:
    """An O_PATH fd of directory ``rel`` under ``base`` that never resolves outside ``base`` (with
    ``in_root``: symlinks resolve as inside a container), and never through a /proc magic link."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    how = _OpenHow(flags, 0, RESOLVE_NO_MAGICLINKS | (RESOLVE_IN_ROOT if in_root else 0))
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(base), ctypes.c_char_p((rel or ".").encode()),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err != errno.ENOSYS:
        raise OSError(err, os.strerror(err), rel)
    fd = os.dup(base)      # an old kernel: one component at a time, following no symlink at all
    for part in filter(None, rel.split("/")):
        try:
            nxt = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd) if part != ".." else -1
        finally:
            os.close(fd)
        if nxt < 0:
            raise OSError(errno.EPERM, "'..' in an ipc path", rel)
        fd = nxt
    return fd


def _socket_fd(root: str | None, path: str) -> int:
    """An O_PATH fd of the socket file itself at ``path`` (inside ``root``); Refused when it is a
    symlink or anything but a socket."""
    base = os.open(root or ("/" if path.startswith("/") else "."), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent, name = os.path.split(path.lstrip("/") if root or path.startswith("/") else path)
        dfd = _open_dir(base, parent, in_root=root is not None)
    finally:
        os.close(base)
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISSOCK(mode):
        os.close(fd)
        what = "a symlink" if stat.S_ISLNK(mode) else "not a socket"
        raise Refused(f"KV events: refused ipc://{path}{' inside ' + root if root else ''}: it is {what}, not the "
                      "server's socket; kvtrace does not connect to it")
    return fd


def connect_unix(path: str) -> socket.socket:
    """A non-blocking unix socket connected to the ipc ``path`` (a /proc/PID/root prefix is the
    server's root, never left); OSError when it cannot connect now, Refused when the path is a
    symlink or no socket.  Nothing is written: check_unix says whose it is."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        if path.startswith("@"):
            s.connect("\0" + path[1:])
            return s
        fd = _socket_fd(*split_root(path))
        try:
            s.connect(f"/proc/self/fd/{fd}")   # the very inode checked above
        finally:
            os.close(fd)
        return s
    except BaseException:
        s.close()
        raise


def check_unix(s: socket.socket, path: str, procs: ServerProcs, since: float) -> None:
    """Refused unless the process listening at the other end of ``s`` (SO_PEERCRED) is the server's."""
    pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if not procs.owns_pid(pid, since):
        raise Refused(f"KV events: refused ipc://{path}: it belongs to pid {pid}, not the server's processes "
                      f"({procs.describe()}); nothing was sent to it")


def server_roots(server, every_s: float = 2.0):
    """``roots()`` for ServerProcs: the discovered server's pid while it runs; once it is gone, the
    vLLM/SGLang server now on the same port in the same network namespace (``--on-restart
    follow``), looked up at most every ``every_s``."""
    state = {"pid": server.pid, "created": _created(server.pid), "at": float("-inf")}

    def roots() -> list[int]:
        if state["created"] is not None and _created(state["pid"]) == state["created"]:
            return [state["pid"]]
        if time.monotonic() - state["at"] >= every_s and server.port is not None:
            from kvtrace.servers import discover  # lazy: only after a restart

            state["at"] = time.monotonic()
            for s in discover.discover():
                if s.port == server.port and s.netns_id == server.netns_id:
                    state.update(pid=s.pid, created=_created(s.pid))
                    return [s.pid]
        return []
    return roots


def _created(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
