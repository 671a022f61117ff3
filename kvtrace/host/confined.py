"""File acts in a tree that another user or a container controls, done as container runtimes
do them: paths resolved beneath a root held open (``/proc/PID/root`` for a server's tree, so a
container's absolute links stay inside it) and never through a symbolic link; directories made
exclusively or checked for owner and mode before they are trusted; files made with
``O_CREAT|O_EXCL|O_NOFOLLOW`` and chmodded and chowned by descriptor; reads non-blocking, of
regular files only, with a size cap.

Resolution uses openat2(2) with RESOLVE_IN_ROOT|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS;
on a kernel without it (before 5.6), a walk that opens one component at a time with
O_NOFOLLOW and refuses "..", which gives the same answer.  Nothing here falls back to
following a link: an act that cannot be confined raises ``UnsafePath`` naming the path and why.
Where a tree's own directory links must be followed (a venv's lib64 -> lib, a container's
/usr/lib/python3 links), ``resolve_dir`` follows them as that root's processes would and
never out of it (RESOLVE_IN_ROOT without RESOLVE_NO_SYMLINKS; the walk reads each link's
target and resolves it from the held root); the files then read there are still no link.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat

from kvtrace.errors import KvtraceError

_RESOLVE = 0x02 | 0x04 | 0x10          # NO_MAGICLINKS | NO_SYMLINKS | IN_ROOT
_RESOLVE_LINKS = 0x02 | 0x10           # NO_MAGICLINKS | IN_ROOT: links followed, inside the root only
MAX_LINKS = 40                         # links followed in one resolution, the kernel's own bound
_SYS_OPENAT2 = 437                     # x86_64 and aarch64 alike
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
READ_LIMIT = 1 << 20


class UnsafePath(KvtraceError):
    """A path another party controls is not what kvtrace may act on (a link, a FIFO, a
    directory someone else owns or can write)."""

    exit_code = 2


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_openat2_ok: bool | None = None


def _openat2(dirfd: int, path: str, flags: int, resolve: int = _RESOLVE) -> int:
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return fd


def _walk(dirfd: int, path: str, flags: int) -> int:
    """openat2's answer without openat2: one component at a time, no link, no "..", from dirfd."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EXDEV, "'..' in a confined path", path)
    cur = os.dup(dirfd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, flags if last else _DIR_FLAGS, dir_fd=cur)
            except NotADirectoryError:
                if stat.S_ISLNK(os.stat(part, dir_fd=cur, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, "a symbolic link", path) from None
                raise
            os.close(cur)
            cur = nxt
        if not parts:
            nxt = os.open(".", flags, dir_fd=cur)
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def open_beneath(dirfd: int, path: str, flags: int) -> int:
    """An fd for ``path`` resolved beneath ``dirfd`` as its root, following no link."""
    global _openat2_ok
    if _openat2_ok is not False:
        try:
            return _openat2(dirfd, path.lstrip("/") or ".", flags | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                _link_on(dirfd, path)   # a link where a directory was asked for: say so
            if e.errno != errno.ENOSYS:
                raise
            _openat2_ok = False
    return _walk(dirfd, path, flags | os.O_NOFOLLOW)


def _link_on(dirfd: int, path: str) -> None:
    """Raise ELOOP if a component of ``path`` beneath dirfd is a symbolic link."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    for i in range(len(parts)):
        try:
            mode = os.stat("/".join(parts[:i + 1]), dir_fd=dirfd, follow_symlinks=False).st_mode
        except OSError:
            return
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, "a symbolic link", path)


def resolve_dir(dirfd: int, path: str) -> int:
    """An fd of the directory ``path`` with ``dirfd`` as its root, following links as a process
    rooted there would, but never out of it: an absolute link starts again from ``dirfd``, ".."
    stops there, no /proc magic link, at most MAX_LINKS links (openat2 RESOLVE_IN_ROOT).
    Raises OSError."""
    global _openat2_ok
    if _openat2_ok is not False:
        try:
            return _openat2(dirfd, path.lstrip("/") or ".", _DIR_FLAGS & ~os.O_NOFOLLOW, _RESOLVE_LINKS)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EAGAIN):   # EAGAIN: a rename raced a ".."
                raise
            if e.errno == errno.ENOSYS:
                _openat2_ok = False
    return _walk_in_root(dirfd, path)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _walk_in_root(dirfd: int, path: str) -> int:
    """resolve_dir without openat2: one component at a time from dirfd, each opened with
    O_NOFOLLOW; a link's target (read, never followed by the kernel) is put in its place, an
    absolute one from dirfd; ".." pops to the directory held before, never above dirfd."""
    stack, todo, links = [os.dup(dirfd)], _parts(path)[::-1], 0
    try:
        while todo:
            part = todo.pop()
            if part == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            if not stat.S_ISLNK(os.stat(part, dir_fd=stack[-1], follow_symlinks=False).st_mode):
                stack.append(os.open(part, _DIR_FLAGS, dir_fd=stack[-1]))
                continue
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(part, dir_fd=stack[-1])
            while target.startswith("/") and len(stack) > 1:
                os.close(stack.pop())
            todo += _parts(target)[::-1]
        return stack.pop()
    finally:
        for fd in stack:
            os.close(fd)


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "it is, or passes through, a symbolic link"
    if e.errno == errno.EXDEV:
        return "it leads out of the tree it must stay in"
    if e.errno == errno.ENOTDIR:
        return "a part of it is not a directory"
    return e.strerror or str(e)


class Root:
    """A filesystem root held open: ``/proc/PID/root`` (a server's, a container's) or "/".
    Closed with ``close()`` or as a context manager."""

    def __init__(self, path: str = "/"):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise UnsafePath(f"cannot open the filesystem root {path}: {e.strerror}") from None
        self.uid = os.fstat(self.fd).st_uid   # a user-namespaced container's root, as seen here

    def __enter__(self) -> "Root":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def opendir(self, path: str, owners: set[int] | None = None, follow_links: bool = False) -> int:
        """An fd of the directory ``path`` in this root, reached through no link (``follow_links``:
        through links resolved inside this root only, as ``resolve_dir``); with ``owners``, it
        must be owned by one of them and writable by no one else unless sticky."""
        try:
            fd = resolve_dir(self.fd, path) if follow_links else open_beneath(self.fd, path, _DIR_FLAGS)
        except OSError as e:
            raise UnsafePath(f"{self.show(path)}: not used, {_why(e)}") from None
        if owners is not None:
            try:
                check_dir(fd, owners, self.show(path))
            except UnsafePath:
                os.close(fd)
                raise
        return fd

    def show(self, path: str) -> str:
        return path if self.path == "/" else f"{self.path.rstrip('/')}{path}"


def check_dir(fd: int, owners: set[int], shown: str, private: bool = False) -> None:
    """Refuse a directory another user could swap things in: owned by one of ``owners``, and
    writable by group or others only with the sticky bit (``private``: not at all)."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{shown}: not used, it is not a directory")
    if st.st_uid not in owners:
        raise UnsafePath(f"{shown}: not used, it is owned by uid {st.st_uid}, not by "
                         f"{' or '.join(f'uid {u}' for u in sorted(owners))}; remove it and try again")
    loose = st.st_mode & 0o022
    if loose and (private or not st.st_mode & stat.S_ISVTX):
        raise UnsafePath(f"{shown}: not used, others can write in it (mode {stat.S_IMODE(st.st_mode):04o})")


def mkdir_exclusive(dirfd: int, name: str, mode: int, shown: str) -> int:
    """Make ``name`` in dirfd, failing if anything is there already, and return its fd after
    checking that it is the directory just made (root's, ``mode`` set by descriptor)."""
    try:
        os.mkdir(name, 0o700, dir_fd=dirfd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
    except OSError as e:
        raise UnsafePath(f"{shown}: cannot be made: {_why(e)}") from None
    try:
        check_dir(fd, {os.geteuid()}, shown, private=True)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def opendir_at(dirfd: int, name: str, shown: str, owners: set[int] | None = None, private: bool = False) -> int:
    """An existing directory ``name`` in dirfd, not a link; checked as ``check_dir`` does."""
    try:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
        except NotADirectoryError:
            _link_on(dirfd, name)
            raise
    except OSError as e:
        raise UnsafePath(f"{shown}: not used, {_why(e)}") from None
    if owners is not None:
        try:
            check_dir(fd, owners, shown, private)
        except UnsafePath:
            os.close(fd)
            raise
    return fd


def write_exclusive(dirfd: int, name: str, data: bytes, mode: int = 0o644, uid: int | None = None,
                    shown: str = "") -> None:
    """Write a new file ``name`` in dirfd: it must not exist (no link followed, nothing
    truncated); mode and owner set by descriptor."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd)
    except OSError as e:
        raise UnsafePath(f"{shown or name}: not written, {_why(e)}") from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1)
    finally:
        os.close(fd)


def read_regular(dirfd: int | None, path: str, limit: int = READ_LIMIT, shown: str = "",
                 follow: bool = False, head: bool = False) -> bytes:
    """The bytes of a regular file, opened without blocking and without following a link in
    its last component (``follow``: for the kernel's own links, /proc/PID/map_files/…); a
    FIFO, device, socket, link or a file over ``limit`` bytes raises (``head``: a larger file
    gives its first ``limit`` bytes)."""
    try:
        fd = os.open(path, READ_FLAGS & ~os.O_NOFOLLOW if follow else READ_FLAGS, dir_fd=dirfd)
    except OSError as e:
        raise UnsafePath(f"{shown or path}: not read, {_why(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{shown or path}: not read, it is not a regular file")
        out = bytearray()
        while len(out) <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - len(out)))
            if not b:
                return bytes(out)
            out += b
        if head:
            return bytes(out[:limit])
        raise UnsafePath(f"{shown or path}: not read, it is larger than {limit} bytes")
    finally:
        os.close(fd)


def remove_tree(dirfd: int, name: str) -> None:
    """Remove ``name`` and all below it, links removed as links (never followed)."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dirfd, ignore_errors=True)
    else:
        try:
            os.unlink(name, dir_fd=dirfd)
        except OSError:
            pass
