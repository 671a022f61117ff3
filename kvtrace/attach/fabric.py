"""What `kvtrace attach` does for the storage fabric, in one place: its options, the probes'
run-time settings (BPF maps), and the sidecars (NVMe topology watcher, kernel-map reader,
NIC counter poller).

attach.py applies ``options`` to its command; attach/session.py calls ``start(pipeline, source)``.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from dataclasses import dataclass, field

import click
import pyarrow as pa

from kvtrace.capture import tcp as tcp_probe
from kvtrace.dataset import schema
from kvtrace.fabric import tcpgate, topology
from kvtrace.fabric.sysfs import kernel_dev
from kvtrace.errors import UsageError

META = "kvtrace.fabric"
NVME_MODES = {"sampled": 0, "all": 1, "none": 2}


@dataclass
class Options:
    nvme_events: str = "sampled"
    nvme_event_rate: int = 20000
    nvme_slow_us: int = 10000
    nvme_tcp_ports: tuple = tcp_probe.DEFAULT_PORTS
    tcp_probe_ms: float = 10.0
    nics: tuple = ()
    nic_interval: float = 0.1
    nic_link_interval: float = 1.0
    nic_netns: str | None = None
    no_nic: bool = False
    uprobes: tuple = ()
    topology_interval: float = 2.0
    root: str = "/"


_OPTS = [
    click.option("--nvme-events", type=click.Choice(sorted(NVME_MODES)), default="sampled", show_default=True,
                 help="Per-command NVMe events: sampled under load, all, or none (errors, retries and slow "
                      "commands are always recorded; per-queue counts and latency histograms are always complete)."),
    click.option("--nvme-event-rate", type=int, default=20000, show_default=True, metavar="N",
                 help="Sampled mode: about N NVMe command events per second at most, over all CPUs."),
    click.option("--nvme-slow-us", type=int, default=10000, show_default=True, metavar="US",
                 help="NVMe commands at least this slow are always recorded (0: none forced)."),
    click.option("--nvme-tcp-port", "nvme_tcp_ports", type=int, multiple=True, metavar="PORT",
                 help="TCP port of NVMe/TCP connections to watch (retransmits, RTT, state). Repeatable; default 4420."),
    click.option("--tcp-probe-ms", type=float, default=10.0, show_default=True, metavar="MS",
                 help="At most one RTT/cwnd sample per connection per this many ms."),
    click.option("--nic", "nics", multiple=True, metavar="IFACE",
                 help="Poll ethtool statistics and link stats64 of this interface. Repeatable; default: the "
                      "netdevs of RDMA devices and the interfaces routing to NVMe-oF targets."),
    click.option("--nic-interval", type=float, default=0.1, show_default=True, metavar="S",
                 help="Seconds between polls of RDMA counters and ethtool statistics."),
    click.option("--nic-link-interval", type=float, default=1.0, show_default=True, metavar="S",
                 help="Seconds between polls of link stats64 (netlink)."),
    click.option("--nic-netns", default=None, metavar="NAME",
                 help="Read the --nic interfaces in this network namespace (ip netns name or path)."),
    click.option("--no-nic", is_flag=True, help="Do not poll NIC or RDMA counters."),
    click.option("--uprobe", "uprobes", multiple=True, metavar="LIB[=PATH]",
                 help="Uprobes on a user-space KV transfer library the tracepoints cannot see: ucx "
                      "(ucp_put_nbx/ucp_get_nbx), cufile (cuFileRead/cuFileWrite), nixl (postXferReq). "
                      "PATH names the library file (default: as mapped by the traced processes). Repeatable."),
]
NAMES = ("nvme_events", "nvme_event_rate", "nvme_slow_us", "nvme_tcp_ports", "tcp_probe_ms", "nics",
         "nic_interval", "nic_link_interval", "nic_netns", "no_nic", "uprobes")


def options(f):
    """Add the fabric options to a click command; their values go to the context, not to ``f``."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        got = {k: kwargs.pop(k) for k in NAMES if k in kwargs}
        if not got.get("nvme_tcp_ports"):
            got.pop("nvme_tcp_ports", None)
        opts = Options(**got)
        check(opts)
        from kvtrace.capture import ulib  # lazy: start-up cost: the CLI imports attach's options for every command

        ulib.requested = parse_uprobes(opts.uprobes)   # the ulib probe is planned only when asked for
        click.get_current_context().meta[META] = opts
        return f(*args, **kwargs)

    for opt in reversed(_OPTS):
        wrapper = opt(wrapper)
    return wrapper


def current_options() -> Options:
    ctx = click.get_current_context(silent=True)
    return (ctx.meta.get(META) if ctx else None) or Options()


def parse_uprobes(specs) -> dict[str, str | None]:
    from kvtrace.capture import ulib  # lazy: start-up cost: the CLI imports attach's options for every command

    out = {}
    for spec in specs:
        lib, _, path = spec.partition("=")
        if lib not in ulib.LIBS:
            raise UsageError(f"--uprobe {spec}: not one of {', '.join(sorted(ulib.LIBS))}")
        if path and not os.path.isfile(path):
            raise UsageError(f"--uprobe {spec}: no such file {path}")
        out[lib] = path or None
    return out


def check(opts: Options) -> None:

    if opts.nvme_event_rate < 0 or opts.nvme_slow_us < 0:
        raise UsageError("--nvme-event-rate and --nvme-slow-us must not be negative")
    if opts.nic_interval <= 0 or opts.nic_link_interval <= 0 or opts.tcp_probe_ms <= 0:
        raise UsageError("--nic-interval, --nic-link-interval and --tcp-probe-ms must be positive")
    for p in opts.nvme_tcp_ports:
        if not 0 < p < 65536:
            raise UsageError(f"--nvme-tcp-port {p}: not a TCP port")
    if opts.nic_netns and not os.path.exists(opts.nic_netns if opts.nic_netns.startswith("/") else f"/run/netns/{opts.nic_netns}"):
        raise UsageError(f"--nic-netns {opts.nic_netns}: no such network namespace")


# ---- the topology watcher ---------------------------------------------------------------------
class TopologyWatcher:
    """A sidecar: the NVMe topology as rows (a snapshot at the start, then what changes: state,
    address, ANA state, controllers and namespaces that appear or vanish), kept on the
    decode context for the decoders, and told to the nvme probe (namespace devices and LBA
    sizes, PCIe queue depths).

    It rescans every ``interval`` seconds, and at once when a decoder meets a controller or
    namespace it does not list (``ctx.nvme_rescan``): a controller connected during the
    capture has its transport, target and LBA size from its first rows on.  Each controller
    or namespace looked for in vain triggers one immediate rescan; asked for again, at most
    one per ``demand_interval`` seconds.  Decoders and ``drain`` run on the pipeline's
    thread; a lock keeps a rescan from any other thread whole."""

    name = "nvme_topology"

    def __init__(self, ctx, tables: dict | None = None, interval: float = 2.0, root: str = "/",
                 demand_interval: float = 1.0):
        self.ctx = ctx
        self.t = tables or {}
        self.interval = interval
        self.demand_interval = demand_interval
        self.root = root
        self.topo: topology.Topology | None = None
        self.pending: dict[str, list] = {}
        self.next = 0.0
        self.changes = 0
        self.scans = 0
        self.demand_scans = 0
        self.map_errors = 0
        self.lock = threading.RLock()
        self.sought: set = set()        # looked for by a rescan on demand and not found
        self.disk_devs: set = set()     # devs of namespace disks seen
        self.remaps: dict[int, int] = {}   # block_remaps: dev a bio went to -> dev it came from
        self.last_demand = float("-inf")
        self.scan()
        ctx.nvme_rescan = self.rescan

    def scan(self) -> None:
        with self.lock:
            new = topology.scan(self.root)
            self._learn_paths(new)
            self.scans += 1
            c, n, h = topology.changes(self.topo, new, time.monotonic_ns())
            if self.topo is not None:
                self.changes += len(c) + len(n)
            for name, rows in (("nvme_ctrl", c), ("nvme_ns", n), ("nvme_hctx", h)):
                if rows:
                    self.pending.setdefault(name, []).extend(rows)
            self.topo = new
            lba = dict(getattr(self.ctx, "nvme_lba", None) or {})
            lba.update({(ns.ctrl_id, ns.nsid): ns.lba_bytes for ns in new.namespaces() if ns.nsid is not None})
            self.ctx.nvme_lba = lba      # every namespace seen in the run (late records of a gone one)
            names = new.disk_names()
            self.ctx.dev_names.update(names)   # hidden multipath paths: named here, not by /sys/dev/block
            self.disk_devs |= set(names)
            self.ctx.nvme_ctrls = new.controllers
            self.ctx.nvme_topology = new
            self._tell_bpf(new)
            self.next = time.monotonic() + self.interval

    def _learn_paths(self, topo: topology.Topology) -> None:
        """Hidden multipath path disks without a dev in sysfs (6.1) still have one in the block
        layer: blockio's ``block_remaps`` map holds each dev a traced bio was remapped to and the
        head it came from.  A head with one such path gives that path its dev (so the nvme probe
        finds the block layer's record of its requests, and block_io rows name it); with several,
        their devs are named by the head."""
        remaps = self.t.get("block_remaps")
        if remaps is not None:
            try:
                for k, v in remaps.items():
                    self.remaps[int(getattr(k, "value", k))] = int(getattr(v, "value", v))
            except Exception:
                self.map_errors += 1
        for path_dev, head_dev in self.remaps.items():
            paths = [ns for ns in topo.namespaces()
                     if ns.multipath and ns.head_dev and kernel_dev(*ns.head_dev) == head_dev]
            if len(paths) == 1 and paths[0].disk_dev is None:
                paths[0].disk_dev = (path_dev >> 20, path_dev & ((1 << 20) - 1))
            elif paths and all(ns.disk_dev is None for ns in paths):
                self.ctx.dev_names[path_dev] = paths[0].head
                self.disk_devs.add(path_dev)

    def _missing(self, ctrls, namespaces, devs=()) -> set:
        known_c = self.topo.controllers if self.topo else {}
        known_n = getattr(self.ctx, "nvme_lba", None) or {}
        return ({("ctrl", int(c)) for c in ctrls if int(c) not in known_c}
                | {("ns", int(c), int(n)) for c, n in namespaces if (int(c), int(n)) not in known_n}
                | {("dev", int(d)) for d in devs if int(d) not in self.disk_devs})

    def rescan(self, ctrls=(), namespaces=(), devs=()) -> bool:
        """Rescan now if ``ctrls`` (ctrl ids), ``namespaces`` ((ctrl_id, nsid)) or ``devs`` (block
        devs without a /sys/dev/block name) are not listed; True when it rescanned."""
        with self.lock:
            missing = self._missing(ctrls, namespaces, devs)
            if not missing:
                return False
            now = time.monotonic()
            if missing <= self.sought and now - self.last_demand < self.demand_interval:
                return False
            self.last_demand = now
            self.demand_scans += 1
            try:
                self.scan()
            except Exception:
                self.map_errors += 1
            asked = self.sought | missing
            still = self._missing([k[1] for k in asked if k[0] == "ctrl"], [k[1:] for k in asked if k[0] == "ns"],
                                  [k[1] for k in asked if k[0] == "dev"])
            self.sought = still if len(still) <= 4096 else set()
            return True

    def _tell_bpf(self, topo: topology.Topology) -> None:
        ns_map, qd_map = self.t.get("nvme_ns"), self.t.get("nvme_qdepth")
        try:
            if ns_map is not None:
                for (ctrl, nsid), (d1, d2, shift) in topo.bpf_namespaces().items():
                    ns_map[ns_map.Key(ctrl_id=ctrl, nsid=nsid)] = ns_map.Leaf(dev1=d1, dev2=d2, lba_shift=shift, pad=0)
            if qd_map is not None:
                for ctrl, depth in topo.queue_depths().items():
                    qd_map[ctypes.c_uint32(ctrl)] = ctypes.c_uint32(depth)
        except Exception:
            self.map_errors += 1

    def drain(self) -> dict[str, pa.Table]:
        with self.lock:
            if time.monotonic() >= self.next:
                try:
                    self.scan()
                except Exception:
                    self.map_errors += 1
            pending, self.pending = self.pending, {}
        out = {}
        for name, rows in pending.items():
            sch = schema.TABLES[name]
            out[name] = pa.table({c: pa.array([r.get(c) for r in rows], sch.field(c).type) for c in sch.names}, schema=sch)
        return out

    def stats(self) -> dict:
        t = self.topo
        return {"controllers": len(t.controllers) if t else 0, "namespaces": len(t.namespaces()) if t else 0,
                "scans": self.scans, "demand_scans": self.demand_scans, "changes": self.changes,
                "map_errors": self.map_errors}

    def close(self) -> None:
        try:
            self.scan()   # the end state: changes since the last scan are recorded
        except Exception:
            self.map_errors += 1


# ---- default interfaces ------------------------------------------------------------------------
def fabric_interfaces(topo: topology.Topology | None, root: str = "/") -> list[str]:
    """RDMA netdevs, and the interfaces routes to NVMe-oF (tcp/rdma) targets leave through."""
    from kvtrace.fabric import counters  # lazy: start-up cost: the CLI imports attach's options for every command

    out = counters.rdma_netdevs(root)
    addrs = sorted({c.traddr for c in (topo.controllers.values() if topo else ()) if c.transport in ("tcp", "rdma") and c.traddr})
    if not addrs:
        return out
    try:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for a in addrs:
                try:
                    for r in ipr.route("get", dst=a):
                        oif = r.get_attr("RTA_OIF")
                        if oif:
                            name = ipr.get_links(oif)[0].get_attr("IFLA_IFNAME")
                            if name and name != "lo" and name not in out:
                                out.append(name)
                except Exception:
                    continue
    except Exception:
        pass
    return out


# ---- start ---------------------------------------------------------------------------------------
@dataclass
class Started:
    sidecars: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)


def _tables(bpf, names) -> dict:
    out = {}
    for n in names:
        try:
            out[n] = bpf[n]
        except Exception:
            pass
    return out


def configure(bpf, plan, opts: Options, ncpus: int | None = None) -> list[str]:
    """Set the probes' run-time settings in their maps; returns notes for the user."""
    notes = []
    ncpus = ncpus or os.cpu_count() or 1
    if "nvme" in plan.attached:
        cfg = bpf["nvme_cfg"]
        budget = max(1, opts.nvme_event_rate // 10 // ncpus)   # per CPU per 100 ms window
        cfg[ctypes.c_int(0)] = cfg.Leaf(slow_ns=opts.nvme_slow_us * 1000, budget=budget,
                                        mode=NVME_MODES[opts.nvme_events], epoch=0, pad=0)
        notes.append(f"nvme events {opts.nvme_events}" + (f" (~{opts.nvme_event_rate}/s)" if opts.nvme_events == "sampled" else ""))
    if "tcp" in plan.attached:
        ports = bpf["tcp_ports"]
        for p in opts.nvme_tcp_ports:
            ports[ctypes.c_uint16(p)] = ctypes.c_uint8(1)
        cfg = bpf["tcp_cfg"]
        cfg[ctypes.c_int(0)] = cfg.Leaf(probe_interval_ns=int(opts.tcp_probe_ms * 1e6))
        notes.append("tcp ports " + ",".join(map(str, opts.nvme_tcp_ports)))
    return notes


def start(pipeline, source, opts: Options | None = None, echo=None) -> Started:
    """Set up the fabric side of a capture: probe settings, topology, map reader, NIC poller.
    Failures here warn and leave the rest of the capture running."""
    echo = echo or (lambda m: click.echo(m, err=True))
    try:
        return _start(pipeline, source, opts or current_options(), echo)
    except Exception as e:  # never take the capture down
        echo(f"kvtrace: warning: fabric side not started ({type(e).__name__}: {e})")
        return Started(warnings=[str(e)])


def _start(pipeline, source, opts: Options, echo) -> Started:
    from kvtrace.fabric import counters  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.capture.kstats import KernelMaps  # lazy: start-up cost: the CLI imports attach's options for every command

    out = Started()
    plan = pipeline.plan
    bpf = getattr(source, "bpf", None)
    try:
        if bpf is not None:
            out.notes += configure(bpf, plan, opts)
    except Exception as e:
        out.warnings.append(f"fabric probe settings: {type(e).__name__}: {e}")
    if bpf is not None and "tcp" in plan.attached and tcpgate.FUNCTION in getattr(bpf, "funcs", {}):
        gate = tcpgate.TcpProbeGate(bpf, opts.nvme_tcp_ports, os.path.join(opts.root, "proc"))
        pipeline.ctx.tcp_seen = gate.wake
        out.sidecars.append(gate)
        if not gate.attached:   # said beside the ports
            out.notes = [n + " (RTT samples from the first connection on one)" if n.startswith("tcp ports") else n
                         for n in out.notes]
    if bpf is not None and "ulib" in plan.attached:
        from kvtrace.capture import ulib  # lazy: start-up cost: the CLI imports attach's options for every command

        notes, warns = ulib.attach(bpf, list(getattr(pipeline, "pids", [])), parse_uprobes(opts.uprobes))
        out.notes += notes
        out.warnings += warns
    maps = _tables(bpf, ("nvme_ns", "nvme_qdepth")) if bpf is not None and "nvme" in plan.attached else {}
    if bpf is not None and "blockio" in plan.attached:
        maps.update(_tables(bpf, ("block_remaps",)))
    watcher = TopologyWatcher(pipeline.ctx, maps, opts.topology_interval, opts.root)
    out.sidecars.append(watcher)
    n = len(watcher.topo.controllers)
    out.notes.append(f"{n} NVMe controller{'s' if n != 1 else ''}" + (
        " (" + ", ".join(f"{c.name} {c.transport}" for c in sorted(watcher.topo.controllers.values(), key=lambda c: c.instance)) + ")" if n else ""))
    if bpf is not None and ("nvme" in plan.attached or "rdma" in plan.attached):
        tables = _tables(bpf, ("nvme_qstats", "nvme_hist", "nvme_drops", "nvme_lbafix", "nvme_start", "rdma_cq"))
        cfg = _tables(bpf, ("nvme_cfg",)).get("nvme_cfg")
        settings = {"nvme_events": opts.nvme_events, "nvme_event_rate": opts.nvme_event_rate,
                    "nvme_slow_us": opts.nvme_slow_us} if "nvme" in plan.attached else {}
        out.sidecars.append(KernelMaps(tables, pipeline.ctx, cfg, settings, opts.root))
    if not opts.no_nic:
        ifaces = list(opts.nics) or ([] if opts.nic_netns else fabric_interfaces(watcher.topo, opts.root))
        rdma_devs = counters.ib_devices(opts.root) if not opts.nic_netns else {}
        if rdma_devs or ifaces:
            poller = counters.NicPoller(interval=opts.nic_interval, rdma=not opts.nic_netns,
                                        ifaces=ifaces, netns=opts.nic_netns, link_interval=opts.nic_link_interval,
                                        root=opts.root)
            out.warnings += poller.start()
            out.sidecars.append(poller)
            what = [f"{d} ({', '.join(p['netdev'] or '?' for p in info['ports'].values())})" for d, info in rdma_devs.items()]
            what += ifaces
            out.notes.append(f"NIC counters of {', '.join(what)} every {opts.nic_interval:g}s")
        else:
            out.notes.append("no RDMA devices and no --nic interfaces: no NIC counters")
    for s in out.sidecars:
        pipeline.add_sidecar(s)
    for w in out.warnings:
        echo(f"kvtrace: warning: {w}")
    echo("kvtrace: fabric: " + "; ".join(out.notes))
    return out
