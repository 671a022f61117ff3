"""Find running servers of every kind kvtrace knows (kvtrace.servers.registry): each kind's
``describe`` recognises its own processes; this module runs them over every process, each
process on a worker thread within DEADLINE_S (reading /proc/PID/cmdline or environ waits for the
process's memory map lock, which a stalled page fault can hold for ever): one that does not
answer in time, or whose files are unsafe, is listed as unreadable and discovery goes on.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass

import psutil

from kvtrace import phases
from kvtrace.host.confined import UnsafePath
from kvtrace.servers import registry
from kvtrace.servers.info import ServerInfo

DEADLINE_S = 2.0   # one process's inspection: its /proc entries and its environment's files
WORKERS = 4        # processes inspected at once (a stalled one holds its thread, not discovery)


@dataclass
class Unreadable:
    """A process discovery could not inspect: its reads did not return within DEADLINE_S, or a
    file of its environment is not safe to read (a FIFO, a device, a link, too large)."""

    pid: int
    reason: str

    def line(self) -> str:
        return f"pid {self.pid}: unreadable ({self.reason})"

    def to_json(self) -> dict:
        return {"pid": self.pid, "port": None, "unreadable": self.reason}


class Servers(list):
    """discover()'s answer: the servers, by API-server pid; ``unreadable``: the processes that
    could not be inspected (Unreadable, by pid)."""

    def __init__(self, servers=(), unreadable=()):
        super().__init__(servers)
        self.unreadable = list(unreadable)


class _Pool:
    """``fn`` on each process on daemon threads, each call within ``deadline`` seconds: a call
    that overruns is given up (its thread left to return or hang alone) and a new thread takes
    its place, so a stalled process never holds up the others."""

    def __init__(self, fn, procs: list, deadline: float, workers: int):
        self.fn, self.deadline, self.ids = fn, deadline, itertools.count()
        self.todo, self.done = queue.SimpleQueue(), queue.SimpleQueue()
        self.running: dict[int, tuple] = {}   # thread number -> (proc, started)
        self.lock = threading.Lock()
        self.pending = {p.pid for p in procs}
        for p in procs:
            self.todo.put(p)
        for _ in range(min(workers, len(procs))):
            self._spawn()

    def _spawn(self) -> None:
        n = next(self.ids)
        threading.Thread(target=self._work, args=(n,), name=f"kvtrace-discover-{n}", daemon=True).start()

    def _work(self, n: int) -> None:
        while True:
            try:
                proc = self.todo.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.running[n] = (proc, time.monotonic())
            try:
                out = (proc, self.fn(proc), None)
            except UnsafePath as e:
                out = (proc, None, str(e))
            except Exception as e:   # one odd process must not end discovery: it is listed with why
                out = (proc, None, f"{type(e).__name__}: {e}")
            with self.lock:
                self.running.pop(n, None)
            self.done.put(out)

    def results(self):
        """(proc, fn's answer, None) or (proc, None, why it was not read), as they come."""
        while self.pending:
            try:
                proc, out, why = self.done.get(timeout=0.05)
                if proc.pid in self.pending:
                    self.pending.discard(proc.pid)
                    yield proc, out, why
            except queue.Empty:
                pass
            for proc in self._overdue():
                self.pending.discard(proc.pid)
                self._spawn()
                yield proc, None, (f"not read within {self.deadline:g} s: a read of its /proc files "
                                   "or of its environment's files did not return")

    def _overdue(self) -> list:
        now = time.monotonic()
        with self.lock:
            return [p for p, t0 in self.running.values() if now - t0 > self.deadline and p.pid in self.pending]


def discover() -> Servers:
    """Every server of every kind in kvtrace.servers.registry on this host (in any container
    whose /proc is visible), by API-server pid, and the processes that could not be inspected
    (``.unreadable``)."""
    phases.mark("discover_start")
    me = os.getpid()
    procs = [p for p in psutil.process_iter() if p.pid != me]
    found, unreadable = [], []
    pool = _Pool(_describe, procs, DEADLINE_S, WORKERS)
    for proc, info, why in pool.results():
        if why is not None:
            unreadable.append(Unreadable(proc.pid, why))
        elif info is not None:
            found.append(info)
    # A spawned API-server child (VLLM::APIServer_<i>) keeps no vllm argv, so no duplicates
    # arise there; but a `vllm serve` started by another vllm process would: keep the outermost.
    inner = {p for s in found for p in s.api_pids[1:] + s.engine_pids + s.worker_pids + s.other_pids}
    mine = inner | {p for s in found for p in s.api_pids}
    phases.mark("discover_end")
    return Servers(sorted((s for s in found if s.pid not in inner), key=lambda s: s.pid),
                   sorted((u for u in unreadable if u.pid not in mine), key=lambda u: u.pid))


def _describe(proc: psutil.Process) -> ServerInfo | None:
    """The first kind that recognises this process describes it."""
    for kind in registry.KINDS.values():
        info = kind.describe(proc)
        if info is not None:
            return info
    return None
