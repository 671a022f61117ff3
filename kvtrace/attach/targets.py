"""Choosing what to trace: existing pids, or a command kvtrace starts itself.

A started command is forked and waits on a pipe until its pid is in the target set,
then execs, so everything the command does is traced (and only a gate read before it).
"""
from __future__ import annotations

import os
import shutil
import signal
import time

import psutil

from kvtrace.errors import TargetError


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
        if shutil.which(argv[0]) is None:
            raise TargetError(f"command not found: {argv[0]}")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: wait at the gate, then become the command (same pid)
            try:
                os.close(w)
                go = os.read(r, 1)
                os.close(r)
                os.closerange(3, 1 << 16)  # no agent fd (BPF maps, dataset files) leaks into the command
                if go:
                    os.execvp(argv[0], argv)
            except BaseException as e:
                os.write(2, f"kvtrace: cannot run {argv[0]}: {e}\n".encode())
            os._exit(127)
        os.close(r)
        self._w = w
        self.pid = pid
        self.returncode: int | None = None

    def release(self) -> None:
        os.write(self._w, b"g")
        os.close(self._w)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def stop(self) -> None:
        """Terminate the command (SIGTERM, then SIGKILL after 5 s) and reap it."""
        if self.poll() is not None:
            return
        os.kill(self.pid, signal.SIGTERM)
        for _ in range(50):
            if self.poll() is not None:
                return
            time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
