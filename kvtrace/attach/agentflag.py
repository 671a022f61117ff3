"""The agent's presence, as the hook inside vLLM sees it: a file named by the agent's pid in
the flag directory (several agents may be attached at once), holding "PID lock", on which the
agent keeps an exclusive flock while it captures user records.

The hook judges the entry by the lock (kvtrace/hook/transport.py): the kernel drops it when the
agent exits, SIGKILL included, so a stale file left behind counts as gone; and it means the same
inside a container, whose pid namespace does not know the agent's pid.  A server in another
mount namespace has its own /dev/shm: ``add_root`` puts the entry there too, through
/proc/PID/root.
"""
from __future__ import annotations

import fcntl
import os

from kvtrace.hook.transport import FLAG_PATH, entry_live


class AgentFlag:
    def __init__(self, path: str = FLAG_PATH):
        self.dir = path
        self.name = str(os.getpid())
        self.path = os.path.join(path, self.name)
        self.held: list[tuple[str, int]] = []   # (entry path, fd holding its lock)

    def _create(self, d: str) -> None:
        if os.path.isfile(d):  # the single-file flag of an older kvtrace
            os.unlink(d)
        os.makedirs(d, mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
        tmp = os.path.join(d, f".{self.name}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{self.name} lock\n".encode())
            os.rename(tmp, os.path.join(d, self.name))   # appears whole and already locked
        except BaseException:
            os.close(fd)
            raise
        self.held.append((os.path.join(d, self.name), fd))

    def __enter__(self) -> "AgentFlag":
        self._create(self.dir)
        self.pruned = prune(self.dir)
        return self

    def add_root(self, root: str) -> bool:
        """Also flag this agent under another filesystem root (``/proc/PID/root`` of a server in
        its own mount namespace); False when that is the flag directory already held."""
        here = os.path.dirname(self.dir.rstrip("/")) or "/"
        there = root.rstrip("/") + here
        try:
            if _same(there, here) or any(_same(os.path.dirname(p), root.rstrip("/") + self.dir) for p, _ in self.held):
                return False
            self._create(root.rstrip("/") + self.dir)
        except OSError:
            return False
        return True

    def __exit__(self, *exc) -> None:
        for path, fd in self.held:
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)
        self.held = []


def prune(path: str) -> int:
    """Remove the entries of agents that are gone (SIGKILLed agents leave theirs behind; the
    hook opens every entry at each re-check, so they would pile up).  An entry is written whole
    and already locked, so one nobody holds is stale.  Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        entry = os.path.join(path, name)
        if name.isdigit() and not entry_live(entry, name):
            try:
                os.unlink(entry)
                removed += 1
            except OSError:
                pass
    return removed


def _same(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
