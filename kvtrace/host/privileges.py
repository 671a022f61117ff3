"""Root and capabilities: which ones kvtrace's agent uses, for what, and what each one's absence
costs; read from /proc/self/status (CapEff).

``CAPABILITIES`` is the one place that says it.  `kvtrace doctor` names the missing ones from it,
and deploy/ (the Kubernetes DaemonSet and the systemd unit) grants exactly ``AGENT_LEAST``.
Each line was measured as uid 0 under ``setpriv`` with everything else dropped, on Linux 6.18
(deploy/README.md has the commands and the errors).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

CAP_DAC_OVERRIDE = 1
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


@dataclass(frozen=True)
class Capability:
    name: str
    number: int
    enables: str   # what kvtrace does with it
    cost: str      # what kvtrace cannot do without it


CAPABILITIES = (
    Capability("CAP_BPF", CAP_BPF,
               "create the BPF maps (the ring buffer) and load the probes",
               "no capture: the probes' maps and programs cannot be created (EPERM)"),
    Capability("CAP_PERFMON", CAP_PERFMON,
               "attach the probes to tracepoints (perf_event_open) and read other processes' /proc/PID/maps",
               "no capture: the probes cannot be loaded or attached (EPERM)"),
    Capability("CAP_SYS_PTRACE", CAP_SYS_PTRACE,
               "live injection of the vLLM hook (ptrace), other processes' /proc/PID/root, exe, fd and ns/net",
               "no live injection into vLLM (kernel probes, KV events and /metrics still run); a server in a "
               "container is not seen as one; descriptors opened before the attach have no path"),
    Capability("CAP_SYS_ADMIN", CAP_SYS_ADMIN,
               "enter a server's network namespace (setns) for its /metrics and KV events; perf's uprobe PMU",
               "no /metrics or KV events of a server in another network namespace; --uprobe only on library "
               "paths short enough for tracefs' 64-character event names"),
    Capability("CAP_DAC_OVERRIDE", CAP_DAC_OVERRIDE,
               "write /proc/PID/mem and read /proc/PID/environ and fd of a server running as another user",
               "no live injection into a vLLM server running as another user, and its descriptors opened before "
               "the attach have no path"),
)
BY_NAME = {c.name: c for c in CAPABILITIES}
# What the deployed agent (deploy/kubernetes, deploy/systemd) is granted: every feature of attach.
AGENT_LEAST = tuple(c.name for c in CAPABILITIES)
# Capture alone (kernel probes, gated commands, --pid of root's processes): these two, or
# CAP_SYS_ADMIN, which the kernel still accepts in their place.
CAPTURE = ("CAP_BPF", "CAP_PERFMON")


def effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def has_cap(cap: int, caps: int | None = None) -> bool:
    caps = effective_caps() if caps is None else caps
    return bool(caps >> cap & 1)


def missing(caps: int | None = None) -> list[Capability]:
    """The capabilities of ``CAPABILITIES`` this process lacks, in table order."""
    caps = effective_caps() if caps is None else caps
    return [c for c in CAPABILITIES if not has_cap(c.number, caps)]


def capture_possible(caps: int | None = None) -> bool:
    """Whether the kernel lets these capabilities load and attach the probes."""
    caps = effective_caps() if caps is None else caps
    return has_cap(CAP_SYS_ADMIN, caps) or all(has_cap(BY_NAME[n].number, caps) for n in CAPTURE)


def missing_for_capture(caps: int | None = None) -> list[str]:
    """What capture needs and this process lacks ([] when it can capture): root (tracefs and
    bcc's compiler), and CAP_BPF + CAP_PERFMON (5.8+) or CAP_SYS_ADMIN."""
    caps = effective_caps() if caps is None else caps
    out = [] if os.geteuid() == 0 else ["root (tracefs and bcc's compiler need it)"]
    if not capture_possible(caps):
        out += [n for n in CAPTURE if not has_cap(BY_NAME[n].number, caps)]
    return out
