"""Root and capabilities from /proc/self/status (CapEff)."""
from __future__ import annotations

import os

CAP_SYS_ADMIN = 21
CAP_SYS_PTRACE = 19
CAP_PERFMON = 38
CAP_BPF = 39


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


def missing_for_capture(caps: int | None = None) -> list[str]:
    """Capabilities capture needs and this process lacks ([] when it can capture).

    bcc loads programs and attaches tracepoints: CAP_BPF + CAP_PERFMON (5.8+), or
    CAP_SYS_ADMIN; it also reads tracefs, which root owns.
    """
    caps = effective_caps() if caps is None else caps
    if has_cap(CAP_SYS_ADMIN, caps) and os.geteuid() == 0:
        return []
    missing = []
    if os.geteuid() != 0:
        missing.append("root (tracefs and bcc's compiler need it)")
    if not has_cap(CAP_SYS_ADMIN, caps):
        for name, cap in (("CAP_BPF", CAP_BPF), ("CAP_PERFMON", CAP_PERFMON)):
            if not has_cap(cap, caps):
                missing.append(name)
    return missing
