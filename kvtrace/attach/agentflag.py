"""The agent's presence, as the hook inside vLLM sees it: a file named by the agent's pid in
the flag directory (several agents may be attached at once), holding "PID lock", on which the
agent keeps an exclusive flock while it captures user records.

The hook judges the entry by the lock (kvtrace/hook/transport.py): the kernel drops it when the
agent exits, SIGKILL included, so a stale file left behind counts as gone; and it means the same
inside a container, whose pid namespace does not know the agent's pid.  A server in another
mount namespace has its own /dev/shm: ``add_root`` puts the entry there too, through
/proc/PID/root.

Every act is confined (kvtrace.host.confined): the parent (/dev/shm) is reached inside the
root without following a link and must be owned by root (or the container's root) and sticky
where others can write; the flag directory is made exclusively, or used only when it is a
directory root owns and nobody else can write; entries are made with O_EXCL|O_NOFOLLOW and
renamed, removed and listed by descriptor.
"""
from __future__ import annotations

import fcntl
import os
import stat

from kvtrace.host import confined
from kvtrace.hook.transport import FLAG_PATH, entry_live


class AgentFlag:
    def __init__(self, path: str = FLAG_PATH):
        self.dir = path
        self.name = str(os.getpid())
        self.path = os.path.join(path, self.name)
        self.held: list[tuple[int, int, str]] = []   # (flag directory fd, fd holding the entry's lock, shown path)

    def _create(self, root: str) -> None:
        shown = self.dir if root == "/" else root.rstrip("/") + self.dir
        dfd = _flag_dir(root, self.dir, shown)
        try:
            st = os.fstat(dfd)
            if any(_same(os.fstat(h), st) for h, _, _ in self.held):
                raise _AlreadyHeld()
            fd = _entry(dfd, self.name)
        except BaseException:
            os.close(dfd)
            raise
        self.held.append((dfd, fd, shown))

    def __enter__(self) -> "AgentFlag":
        self._create("/")
        self.pruned = prune(self.dir, self.held[0][0])
        return self

    def add_root(self, root: str) -> bool:
        """Also flag this agent under another filesystem root (``/proc/PID/root`` of a server in
        its own mount namespace); False when that is the flag directory already held.  Raises
        UnsafePath, naming the path and why, where the root's /dev/shm cannot be trusted."""
        try:
            self._create(root)
        except _AlreadyHeld:
            return False
        return True

    def __exit__(self, *exc) -> None:
        for dfd, fd, _ in self.held:
            try:
                os.unlink(self.name, dir_fd=dfd)
            except OSError:
                pass
            os.close(fd)
            os.close(dfd)
        self.held = []


class _AlreadyHeld(Exception):
    pass


def _flag_dir(root: str, path: str, shown: str) -> int:
    """The flag directory's fd in ``root``: made here, or root's and written by no one else."""
    parent, name = os.path.split(path.rstrip("/"))
    with confined.Root(root) as r:
        pfd = r.opendir(parent or "/", owners={0, r.uid})
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return confined.mkdir_exclusive(pfd, name, 0o755, shown)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(name, dir_fd=pfd)        # the single-file flag of an older kvtrace
            return confined.mkdir_exclusive(pfd, name, 0o755, shown)
        return confined.opendir_at(pfd, name, shown, owners={os.geteuid()}, private=True)
    finally:
        os.close(pfd)


def _entry(dfd: int, name: str) -> int:
    """Write "PID lock" under ``name``, whole and already locked; returns the locked fd."""
    tmp = f".{name}.tmp"
    try:
        os.unlink(tmp, dir_fd=dfd)   # a link or file left by an earlier agent of this pid: removed, never followed
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{name} lock\n".encode())
        os.fchmod(fd, 0o644)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)   # appears whole and already locked
    except BaseException:
        os.close(fd)
        raise
    return fd


def prune(path: str, dir_fd: int | None = None) -> int:
    """Remove the entries of agents that are gone (SIGKILLed agents leave theirs behind; the
    hook opens every entry at each re-check, so they would pile up).  An entry is written whole
    and already locked, so one nobody holds is stale.  Returns how many were removed.
    ``dir_fd``: the flag directory, opened and checked (else ``path`` is opened here)."""
    removed = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC) if dir_fd is None \
            else os.dup(dir_fd)
    except OSError:
        return 0
    try:
        for name in os.listdir(fd):
            if name.isdigit() and not entry_live(name, name, dir_fd=fd):
                try:
                    os.unlink(name, dir_fd=fd)
                    removed += 1
                except OSError:
                    pass
    finally:
        os.close(fd)
    return removed


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
