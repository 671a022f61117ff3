"""tcp:tcp_probe runs on every TCP segment the host receives, on any connection: a serving
host's HTTP traffic ran it 700-1,400 times a second in the overhead benchmark, for nothing
when no connection is on an NVMe/TCP port.  The gate keeps that program detached until there
is one: a socket on a watched port in any network namespace at the start, or any event of the
tcp probe's other programs (state changes, retransmits: they are filtered by port in the
kernel and cost nothing meanwhile).  Once attached it stays.  A sidecar for the run row."""
from __future__ import annotations

import os
import time

TRACEPOINT = b"tcp:tcp_probe"
FUNCTION = b"tracepoint__tcp__tcp_probe"


def _ports_in(text: str) -> set[int]:
    """Local and remote ports of every socket in a /proc/net/tcp{,6} table."""
    out = set()
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) > 2:
            for addr in f[1:3]:
                try:
                    out.add(int(addr.rsplit(":", 1)[1], 16))
                except (IndexError, ValueError):
                    pass
    return out


def sockets_on(ports, proc: str = "/proc") -> bool:
    """Whether any TCP socket of any network namespace has a port in ``ports`` (one process
    per namespace is asked; kernel sockets, such as nvme-tcp's, show in their namespace's table)."""
    want, seen = set(ports), set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            ns = os.stat(f"{proc}/{pid}/ns/net").st_ino
        except OSError:
            continue
        if ns in seen:
            continue
        seen.add(ns)
        for table in ("tcp", "tcp6"):
            try:
                with open(f"{proc}/{pid}/net/{table}") as f:
                    if _ports_in(f.read()) & want:
                        return True
            except OSError:
                pass
    return False


class TcpProbeGate:
    """Detaches ``tcp:tcp_probe`` (bcc attached it with the rest) unless a socket on a watched
    port exists; ``wake()`` (the tcp decoder, on any event) attaches it."""

    name = "tcp_probe_gate"

    def __init__(self, bpf, ports, proc: str = "/proc"):
        self.bpf = bpf
        self.attached = True
        self.attached_ns = 0     # when the gate attached it (0: from the start, or never)
        self.errors = 0
        try:
            found = sockets_on(ports, proc)
        except OSError:   # no /proc to ask: leave it attached
            found = True
        if not found:
            try:
                bpf.detach_tracepoint(TRACEPOINT)
                self.attached = False
            except Exception:
                self.errors += 1

    def wake(self) -> None:
        if self.attached:
            return
        try:
            self.bpf.attach_tracepoint(tp=TRACEPOINT, fn_name=FUNCTION)
        except Exception:
            self.errors += 1
            return
        self.attached, self.attached_ns = True, time.monotonic_ns()

    def drain(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {"attached": self.attached, "attached_ns": self.attached_ns, "errors": self.errors}
