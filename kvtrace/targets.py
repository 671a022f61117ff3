"""Choosing what to trace: existing pids, or a command kvtrace starts itself.

A started command waits on a pipe until its pid is in the target set, so its first
system call is already traced.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil

from kvtrace.errors import TargetError

# Runs in the child: wait for the go byte on the gate fd, then become the command (same pid).
_GATE = (
    "import os,sys\n"
    "g = int(sys.argv[1]); go = os.read(g, 1); os.close(g)\n"
    "go or sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def check_pids(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                raise TargetError(f"process {pid} has exited (zombie): give a running pid")
        except psutil.NoSuchProcess:
            raise TargetError(f"no such process: {pid} (check the pid with ps, or start the command with `kvtrace attach ... -- CMD`)") from None
        if pid == os.getpid():
            raise TargetError("kvtrace cannot trace itself")
        out.append(pid)
    return out


class GatedCommand:
    """A command started stopped at a gate; ``release()`` lets it exec."""

    def __init__(self, argv: list[str]):
        if not argv:
            raise TargetError("no command given after --")
        if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
            raise TargetError(f"command not found: {argv[0]}")
        r, w = os.pipe()
        self._w = w
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _GATE, str(r), *argv],
            pass_fds=(r,),
        )
        os.close(r)
        self.pid = self.proc.pid

    def release(self) -> None:
        os.write(self._w, b"g")
        os.close(self._w)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
