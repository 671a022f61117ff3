"""Every capability check `kvtrace doctor` reports, gathered at once.

Each check says what the host offers and what kvtrace does with it, so a user sees every
gap in one table instead of meeting them one by one.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.host import privileges, tracefs
from kvtrace.fabric import counters, topology

OK, MISSING, ABSENT_FINE = "ok", "missing", "absent"


@dataclass
class Check:
    name: str
    status: str          # ok / missing / absent (absent and fine)
    detail: str
    use: str             # what kvtrace does with it
    required: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    missing_capabilities: list[dict] = field(default_factory=list)

    @property
    def capture_available(self) -> bool:
        return all(c.ok for c in self.checks if c.required)

    def to_json(self) -> dict:
        return {
            "capture_available": self.capture_available,
            "kernel": platform.release(),
            "checks": [c.__dict__ for c in self.checks],
            "missing_capabilities": self.missing_capabilities,
        }


# (family name, tracepoints that make it up (any one present is enough), what it feeds)
FAMILIES = [
    ("block io_start/done (6.5+)", [("block", "block_io_start"), ("block", "block_io_done")], "block I/O submitter (pid/tid)"),
    ("block rq issue/complete", [("block", "block_rq_issue"), ("block", "block_rq_complete")], "block I/O queue and device latency"),
    ("block bio_queue", [("block", "block_bio_queue")], "submitter on kernels before 6.5"),
    ("syscalls read/pread/readv", [("syscalls", "sys_enter_pread64"), ("syscalls", "sys_enter_read")], "file reads by syscall"),
    ("syscalls openat", [("syscalls", "sys_enter_openat")], "fd to path"),
    ("filemap page-cache fill", [("filemap", "mm_filemap_add_to_page_cache")], "reads through mmap: page-cache fills"),
    ("filemap fault (6.10+)", [("filemap", "mm_filemap_fault"), ("filemap", "mm_filemap_map_pages")],
     "reads through mmap: page faults on files"),
    ("io_uring", [("io_uring", "io_uring_submit_req"), ("io_uring", "io_uring_submit_sqe"), ("io_uring", "io_uring_complete")], "io_uring submit/complete"),
    ("sched fork/exit", [("sched", "sched_process_fork"), ("sched", "sched_process_exit")], "follow children"),
    ("nvme", [("nvme", "nvme_setup_cmd"), ("nvme", "nvme_complete_rq")], "NVMe(-oF) per-queue commands"),
    ("rdma_core", [("rdma_core", "cq_poll")], "kernel RDMA CQ polling (nvme-rdma)"),
    ("rdma_cma", [("rdma_cma", "cm_event_handler")], "RDMA connection events"),
    ("tcp", [("tcp", "tcp_retransmit_skb"), ("tcp", "tcp_probe")], "NVMe/TCP retransmits and RTT"),
]


def _bcc() -> Check:
    try:
        import bcc  # noqa: F401  (capture side only: doctor reports whether it imports)

        return Check("bcc (python3-bpfcc)", OK, f"{bcc.__file__}", "compiles and loads the probes", True)
    except Exception as e:  # ImportError, or a broken libbcc
        return Check("bcc (python3-bpfcc)", MISSING, f"{type(e).__name__}: {e}; apt-get install python3-bpfcc and use /usr/bin/python3 or a --system-site-packages venv", "compiles and loads the probes", True)


def _headers() -> Check:
    build = Path("/lib/modules") / platform.release() / "build"
    if os.environ.get("BCC_KERNEL_SOURCE"):
        build = Path(os.environ["BCC_KERNEL_SOURCE"])
    if (build / "include" / "linux" / "kconfig.h").exists() or (build / "include" / "generated").exists():
        return Check("kernel headers", OK, f"{build} -> {os.path.realpath(build)}", "bcc compiles against them", True)
    if Path("/sys/kernel/kheaders.tar.xz").exists():
        return Check("kernel headers", OK, "/sys/kernel/kheaders.tar.xz", "bcc compiles against them", True)
    return Check("kernel headers", MISSING, f"no {build}; install linux-headers-amd64 and run scripts/setup-host (links the nearest tree)", "bcc compiles against them", True)


def _cost(cap: privileges.Capability, caps: int) -> str:
    """What this missing capability costs here (nothing for capture while CAP_SYS_ADMIN stands in)."""
    if cap.name in privileges.CAPTURE and privileges.capture_possible(caps):
        return "none while CAP_SYS_ADMIN is held (the kernel accepts it in its place)"
    return cap.cost


def missing_capabilities(caps: int | None = None) -> list[dict]:
    """Each capability of kvtrace's table this process lacks: name, number, what it costs."""
    caps = privileges.effective_caps() if caps is None else caps
    return [{"name": c.name, "number": c.number, "cost": _cost(c, caps)} for c in privileges.missing(caps)]


def _capability(cap: privileges.Capability, caps: int) -> Check:
    have = privileges.has_cap(cap.number, caps)
    detail = f"CapEff bit {cap.number}" + ("" if have else " not set: " + _cost(cap, caps).split(";")[0])
    required = cap.name in privileges.CAPTURE and not privileges.capture_possible(caps)
    return Check(cap.name, OK if have else MISSING, detail, cap.enables, required)


def _privileges() -> list[Check]:
    caps = privileges.effective_caps()
    root = os.geteuid() == 0
    out = [Check("root", OK if root else MISSING, f"euid={os.geteuid()}, CapEff=0x{caps:x}", "tracefs and bcc's compiler need it", True)]
    return out + [_capability(c, caps) for c in privileges.CAPABILITIES]


def _kernel_features() -> list[Check]:
    base = tracefs.root()
    out = [
        Check("tracefs", OK if base else MISSING, str(base) if base else "mount -t tracefs tracefs /sys/kernel/tracing", "tracepoint formats and existence", True),
        Check("BTF", OK if Path("/sys/kernel/btf/vmlinux").exists() else MISSING, "/sys/kernel/btf/vmlinux", "struct offsets for raw tracepoints (optional)", False),
    ]
    uprobes = bool(base) and (base / "uprobe_events").exists()
    out.append(Check("uprobes", OK if uprobes else MISSING, "uprobe_events" if uprobes else "CONFIG_UPROBE_EVENTS off", "--uprobe ucx|cufile|nixl (opt-in)", False))
    kprobes = bool(base) and (base / "kprobe_events").exists()
    out.append(Check("kprobes", OK if kprobes else ABSENT_FINE, "present (unused)" if kprobes else "absent: kvtrace uses tracepoints only", "not needed", False))
    for name, tps, use in FAMILIES:
        present = [f"{c}:{e}" for c, e in tps if tracefs.tracepoint_exists(c, e)]
        status = OK if present else ABSENT_FINE
        detail = ", ".join(present) if present else "not in this kernel: skipped"
        out.append(Check(f"tracepoints: {name}", status, detail, use, False))
    syscalls = any(c.ok for c in out if c.name.startswith("tracepoints: syscalls read"))
    block = any(c.ok for c in out if c.name.startswith("tracepoints: block rq"))
    if not (syscalls or block):
        out.append(Check("capture families", MISSING, "neither syscall nor block tracepoints exist", "nothing to capture", True))
    return out


def _fabric(root: str = "/") -> list[Check]:
    """NVMe controllers with their transport and target, RDMA devices with their counters
    (or that there are none), and pyroute2 for the NIC counters."""

    out = []
    topo = topology.scan(root)
    if not topo.controllers:
        out.append(Check("NVMe controllers", ABSENT_FINE, "none on this host (no /sys/class/nvme/nvme*)",
                         "NVMe topology: transport and target of each command", False))
    for line, c in zip(topo.summary(), sorted(topo.controllers.values(), key=lambda c: c.instance)):
        out.append(Check(f"NVMe {c.name} ({c.transport or '?'})", OK if c.state == "live" else MISSING, line,
                         "transport, target and queues of its commands", False))
    devs = counters.ib_devices(root)
    if not devs:
        out.append(Check("RDMA devices", ABSENT_FINE, "none on this host (no /sys/class/infiniband/*)",
                         "RDMA port counters and hw_counters (RoCE congestion, retransmits)", False))
    for dev, info in sorted(devs.items()):
        ports = "; ".join(
            f"port {n}: {p['netdev'] or '-'} {p['link_layer'] or '?'} {(p['state'] or '?').split(': ')[-1]} "
            f"{p['rate'] or ''}, {p['counters']} counters, {p['hw_counters']} hw_counters".replace("  ", " ")
            for n, p in sorted(info["ports"].items()))
        dev_hw = f"; device: {info['hw_counters']} hw_counters" if info["hw_counters"] else ""
        out.append(Check(f"RDMA {dev} ({info['driver']})", OK, (ports or "no ports") + dev_hw,
                         "counters polled as deltas into nic_counters", False))
    try:
        import pyroute2

        out.append(Check("pyroute2", OK, f"{pyroute2.__version__}", "ethtool statistics and link stats64 of NICs", False))
    except Exception as e:
        out.append(Check("pyroute2", MISSING, f"{type(e).__name__}: {e}", "ethtool statistics and link stats64 of NICs", False))
    return out


def _servers() -> list[Check]:
    """Each vLLM server found here: its vLLM version and whether the hook supports it."""
    from kvtrace.servers import discover, hooksupport  # lazy: discovery walks /proc, only doctor's last rows need it

    out = []
    for info in discover.discover():
        v = hooksupport.verdict(info)
        status = OK if v is not None and v["supported"] else MISSING
        out.append(Check(f"vLLM server {info.pid} (port {info.port})", status, hooksupport.describe(info, v),
                         "the hook: steps, chunks, hits, evictions, preemptions, KV loads", False))
    return out


def run_all() -> Report:
    report = Report(missing_capabilities=missing_capabilities())
    report.checks.extend(_privileges())
    report.checks.extend(_kernel_features())
    report.checks.append(_headers())
    report.checks.append(_bcc())
    report.checks.extend(_fabric())
    report.checks.extend(_servers())
    return report
