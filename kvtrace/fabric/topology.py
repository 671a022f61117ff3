"""NVMe topology from sysfs: controllers and their transport (pcie, tcp, rdma, fc, loop), target
address, subsystem, namespaces and the disks they appear as, native-multipath heads and their
per-controller paths with ANA state, and the hardware-queue -> CPU map; plus the way back
from a block device or a file to the controllers (and so the transport and target) its I/O
goes through.

Layout read (drivers/nvme/host/{sysfs,multipath,fabrics}.c):

    /sys/class/nvme/nvmeN/                     controller N (the tracepoints' ctrl_id)
        transport address subsysnqn state cntlid model serial firmware_rev queue_count
        sqsize numa_node hostnqn
        nvmeNnH/ or nvmeScNnH/                 its namespaces: plain disk, or path of head nvmeSnH
            nsid ana_state ana_grpid queue/logical_block_size size mq/<hctx>/cpu_list
    /sys/class/nvme-subsystem/nvme-subsysS/    subsysnqn iopolicy, head disks nvmeSnH/, nvmeN links
    /sys/dev/block/M:m                         -> the disk or partition of a dev_t

Everything is read under a root directory so recorded trees serve as tests; nothing raises
on a missing or odd file (it reads as absent).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvtrace.fabric.sysfs import Root, kernel_dev, parse_cpulist, parse_devt

CTRL_RE = re.compile(r"^nvme(\d+)$")
NS_RE = re.compile(r"^nvme(\d+)(?:c(\d+))?n(\d+)$")
ANA_STATES = ("optimized", "non-optimized", "inaccessible", "persistent-loss", "change")


@dataclass
class Hctx:
    index: int
    qid: int              # the tracepoints' qid: hctx index + 1 (0 is the admin queue)
    cpus: list[int]
    nr_tags: int | None


@dataclass
class Namespace:
    disk: str             # where the controller's requests go: nvmeScNnH (a path) or nvmeNnH
    head: str             # the block device applications open: nvmeSnH (or the plain disk)
    ctrl: str
    ctrl_id: int
    nsid: int | None
    multipath: bool
    ana_state: str        # "" when the subsystem has no ANA
    ana_grpid: int | None
    lba_bytes: int
    size_bytes: int
    head_dev: tuple[int, int] | None
    disk_dev: tuple[int, int] | None   # the dev the block layer reports for the disk, from its sysfs `dev`; a
                                       # hidden multipath path has none there (6.1 still gives it one in the block
                                       # layer: kvtrace.attach.fabric learns it from the probe's remaps)
    hctx: list[Hctx] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)

    @property
    def lba_shift(self) -> int:
        return max(9, self.lba_bytes.bit_length() - 1) if self.lba_bytes > 0 else 9


@dataclass
class Controller:
    name: str
    instance: int
    transport: str        # pcie, tcp, rdma, fc, loop, apple-nvme, ...
    address: str          # raw: "traddr=...,trsvcid=..." (fabrics) or the PCI function (pcie)
    traddr: str
    trsvcid: str
    host_traddr: str
    src_addr: str
    subsysnqn: str
    subsystem: str        # nvme-subsysS
    state: str            # live, connecting, resetting, deleting, dead, new
    cntlid: int | None
    model: str
    serial: str
    firmware: str
    queue_count: int | None
    sqsize: int | None
    numa_node: int | None
    hostnqn: str
    namespaces: list[Namespace] = field(default_factory=list)

    @property
    def target(self) -> str:
        """Where its I/O goes: traddr:trsvcid for fabrics, the PCI function for pcie."""
        if self.traddr:
            return f"{self.traddr}:{self.trsvcid}" if self.trsvcid else self.traddr
        return self.address

    @property
    def io_queue_depth(self) -> int | None:
        """PCIe I/O queue depth (sqsize is 0-based): the modulus of SQ head/tail."""
        return self.sqsize + 1 if self.sqsize is not None and self.sqsize >= 0 else None


@dataclass
class Subsystem:
    name: str
    nqn: str
    iopolicy: str
    heads: list[str]
    ctrls: list[str]


@dataclass
class Mount:
    dev: tuple[int, int]
    mountpoint: str
    fstype: str
    source: str


def parse_address(text: str | None) -> dict[str, str]:
    """'traddr=10.0.0.2,trsvcid=4420,src_addr=10.0.0.1' -> dict; a PCI function -> {}."""
    out = {}
    for part in (text or "").split(","):
        k, sep, v = part.strip().partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def parse_mountinfo(text: str | None) -> list[Mount]:
    out = []
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) < 10 or "-" not in parts:
            continue
        dash = parts.index("-")
        dev = parse_devt(parts[2])
        if dev is None or dash + 2 >= len(parts):
            continue
        mp = parts[4].replace("\\040", " ")
        out.append(Mount(dev, mp, parts[dash + 1], parts[dash + 2]))
    return out


@dataclass
class Topology:
    controllers: dict[int, Controller] = field(default_factory=dict)
    subsystems: dict[str, Subsystem] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    root: str = "/"

    # ---- lookups -------------------------------------------------------------------------
    def namespaces(self) -> list[Namespace]:
        return [ns for c in self.controllers.values() for ns in c.namespaces]

    def by_head(self, name: str) -> list[Namespace]:
        return [ns for ns in self.namespaces() if ns.head == name or ns.disk == name]

    def nvme_disks_under(self, major: int, minor: int) -> list[str]:
        """NVMe disks a block device sits on: itself, a partition's disk, or (through
        slaves) what a device-mapper / md device is built from."""
        r = Root(self.root)
        seen, out, todo = set(), [], [f"/sys/dev/block/{major}:{minor}"]
        while todo:
            p = todo.pop()
            real = r.path(p)
            try:
                real = os.path.realpath(real)
            except OSError:
                continue
            if real in seen:
                continue
            seen.add(real)
            rel = r.relative(real)
            name = os.path.basename(real)
            if r.exists(rel + "/partition"):  # a partition: its disk is the parent directory
                rel = os.path.dirname(rel)
                name = os.path.basename(rel)
            if NS_RE.match(name):
                out.append(name)
                continue
            for s in r.listdir(rel + "/slaves"):
                todo.append(f"{rel}/slaves/{s}")
        return sorted(set(out))

    def for_dev(self, major: int, minor: int) -> list[Namespace]:
        """The namespace paths (one per controller) carrying I/O of block device major:minor."""
        out = []
        for name in self.nvme_disks_under(major, minor):
            out.extend(self.by_head(name))
        return out

    def mount_of(self, path: str) -> Mount | None:
        path = os.path.abspath(path)
        best = None
        for m in self.mounts:
            mp = m.mountpoint.rstrip("/") or "/"
            if path == mp or path.startswith(mp + "/") or mp == "/":
                if best is None or len(mp) > len(best.mountpoint.rstrip("/") or "/"):
                    best = m
        return best

    def for_path(self, path: str) -> list[Namespace]:
        """The namespace paths carrying I/O of a file (its filesystem's device)."""
        dev = None
        if self.root in ("/", ""):
            try:
                st = os.stat(path)
                dev = (os.major(st.st_dev), os.minor(st.st_dev))
            except OSError:
                dev = None
        if dev is None or dev[0] == 0:  # not on this host, or an anonymous dev (btrfs, overlay)
            m = self.mount_of(path)
            dev = m.dev if m else None
        return self.for_dev(*dev) if dev else []

    # ---- what the BPF side needs -----------------------------------------------------------
    def bpf_namespaces(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """(ctrl_id, nsid) -> (dev of the disk as block tracepoints report it (0: a hidden path
        disk without one), dev of the multipath head (0: none), log2 logical block size)."""
        out = {}
        for ns in self.namespaces():
            if ns.nsid is None:
                continue
            d1 = kernel_dev(*ns.disk_dev) if ns.disk_dev else 0
            d2 = kernel_dev(*ns.head_dev) if ns.multipath and ns.head_dev else 0
            out[(ns.ctrl_id, ns.nsid)] = (d1, d2, ns.lba_shift)
        return out

    def disk_names(self) -> dict[int, str]:
        """Block-layer dev (major << 20 | minor) -> disk name, for the namespace disks that have a
        dev but no /sys/dev/block link (hidden multipath paths)."""
        return {kernel_dev(*ns.disk_dev): ns.disk for ns in self.namespaces() if ns.disk_dev}

    def queue_depths(self) -> dict[int, int]:
        return {c.instance: c.io_queue_depth for c in self.controllers.values()
                if c.transport == "pcie" and c.io_queue_depth}

    def summary(self) -> list[str]:
        """One line per controller, for `kvtrace doctor`."""
        lines = []
        for c in sorted(self.controllers.values(), key=lambda c: c.instance):
            nss = ", ".join(
                f"{ns.disk}{'->' + ns.head if ns.multipath else ''}"
                f"{' ana=' + ns.ana_state if ns.ana_state else ''}" for ns in c.namespaces) or "no namespaces"
            lines.append(f"{c.name} {c.transport or '?'} {c.target or '-'} {c.state or '?'} "
                         f"nqn={c.subsysnqn or '-'}: {nss}")
        return lines


def _ctrl(r: Root, name: str, inst: int) -> Controller:
    base = f"/sys/class/nvme/{name}"
    addr = r.read(f"{base}/address", "") or ""
    a = parse_address(addr)
    subsys = ""
    for entry in r.listdir("/sys/class/nvme-subsystem"):
        if name in r.listdir(f"/sys/class/nvme-subsystem/{entry}"):
            subsys = entry
            break
    return Controller(
        name=name, instance=inst, transport=r.read(f"{base}/transport", "") or "", address=addr,
        traddr=a.get("traddr", ""), trsvcid=a.get("trsvcid", ""), host_traddr=a.get("host_traddr", ""),
        src_addr=a.get("src_addr", ""), subsysnqn=r.read(f"{base}/subsysnqn", "") or "", subsystem=subsys,
        state=r.read(f"{base}/state", "") or "", cntlid=r.read_int(f"{base}/cntlid"),
        model=r.read(f"{base}/model", "") or "", serial=r.read(f"{base}/serial", "") or "",
        firmware=r.read(f"{base}/firmware_rev", "") or "", queue_count=r.read_int(f"{base}/queue_count"),
        sqsize=r.read_int(f"{base}/sqsize"), numa_node=r.read_int(f"{base}/numa_node"),
        hostnqn=r.read(f"{base}/hostnqn", "") or "",
    )


def _hctx(r: Root, disk_dir: str) -> list[Hctx]:
    out = []
    for h in r.listdir(f"{disk_dir}/mq"):
        if not h.isdigit():
            continue
        i = int(h)
        out.append(Hctx(i, i + 1, parse_cpulist(r.read(f"{disk_dir}/mq/{h}/cpu_list")),
                        r.read_int(f"{disk_dir}/mq/{h}/nr_tags")))
    return sorted(out, key=lambda h: h.index)


def _namespace(r: Root, ctrl: Controller, disk: str) -> Namespace:
    m = NS_RE.match(disk)
    ddir = f"/sys/class/nvme/{ctrl.name}/{disk}"
    multipath = m is not None and m.group(2) is not None
    head = f"nvme{m.group(1)}n{m.group(3)}" if multipath else disk
    hdir = f"/sys/block/{head}"
    nsid = r.read_int(f"{ddir}/nsid")
    if nsid is None:
        nsid = r.read_int(f"{hdir}/nsid")
    lba = r.read_int(f"{ddir}/queue/logical_block_size") or r.read_int(f"{hdir}/queue/logical_block_size") or 512
    size = r.read_int(f"{hdir}/size") or r.read_int(f"{ddir}/size") or 0
    return Namespace(
        disk=disk, head=head, ctrl=ctrl.name, ctrl_id=ctrl.instance, nsid=nsid, multipath=multipath,
        ana_state=r.read(f"{ddir}/ana_state", "") or "", ana_grpid=r.read_int(f"{ddir}/ana_grpid"),
        lba_bytes=lba, size_bytes=size * 512, head_dev=parse_devt(r.read(f"{hdir}/dev")),
        disk_dev=parse_devt(r.read(f"{ddir}/dev")), hctx=_hctx(r, ddir),
    )


def scan(root: str | os.PathLike = "/") -> Topology:
    """Read the NVMe topology under ``root``.  Never raises."""
    r = Root(root)
    topo = Topology(root=str(root))
    for entry in r.listdir("/sys/class/nvme-subsystem"):
        base = f"/sys/class/nvme-subsystem/{entry}"
        names = r.listdir(base)
        topo.subsystems[entry] = Subsystem(
            entry, r.read(f"{base}/subsysnqn", "") or "", r.read(f"{base}/iopolicy", "") or "",
            heads=[n for n in names if NS_RE.match(n) and "c" not in n[4:]],
            ctrls=[n for n in names if CTRL_RE.match(n)])
    for name in r.listdir("/sys/class/nvme"):
        m = CTRL_RE.match(name)
        if not m:
            continue
        ctrl = _ctrl(r, name, int(m.group(1)))
        for entry in r.listdir(f"/sys/class/nvme/{name}"):
            if NS_RE.match(entry):
                ctrl.namespaces.append(_namespace(r, ctrl, entry))
        topo.controllers[ctrl.instance] = ctrl
    topo.mounts = parse_mountinfo(r.read("/proc/self/mountinfo"))
    for ns in topo.namespaces():
        mps = []
        for mnt in topo.mounts:
            if ns.head in topo.nvme_disks_under(*mnt.dev):
                mps.append(mnt.mountpoint)
        ns.mounts = sorted(set(mps))
    return topo


# ---- dataset rows ----------------------------------------------------------------------------
CTRL_KEYS = ("transport", "traddr", "trsvcid", "host_traddr", "src_addr", "address", "subsysnqn", "subsystem",
             "state", "cntlid", "model", "serial", "firmware", "queue_count", "sqsize", "numa_node", "hostnqn")
NS_KEYS = ("head", "nsid", "multipath", "ana_state", "ana_grpid", "lba_bytes", "size_bytes", "mounts")


def ctrl_row(c: Controller, ts_ns: int, event: str, iopolicy: str = "") -> dict:
    row = {"ts_ns": ts_ns, "event": event, "ctrl": c.name, "ctrl_id": c.instance, "target": c.target,
           "iopolicy": iopolicy}
    for k in CTRL_KEYS:
        row[k] = getattr(c, k)
    return row


def ns_row(ns: Namespace, c: Controller, ts_ns: int, event: str) -> dict:
    row = {"ts_ns": ts_ns, "event": event, "ctrl": ns.ctrl, "ctrl_id": ns.ctrl_id, "disk": ns.disk,
           "transport": c.transport, "target": c.target,
           "head_major": ns.head_dev[0] if ns.head_dev else None, "head_minor": ns.head_dev[1] if ns.head_dev else None}
    for k in NS_KEYS:
        row[k] = getattr(ns, k)
    return row


def hctx_rows(ns: Namespace, ts_ns: int) -> list[dict]:
    return [{"ts_ns": ts_ns, "ctrl": ns.ctrl, "ctrl_id": ns.ctrl_id, "disk": ns.disk, "hctx": h.index, "qid": h.qid,
             "cpus": h.cpus, "nr_tags": h.nr_tags} for h in ns.hctx]


def changes(old: Topology | None, new: Topology, ts_ns: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Rows for what differs: everything as ``snapshot`` when ``old`` is None, else
    ``appeared``, ``vanished`` and ``changed`` (state, address, ANA state, ...) rows."""
    iop = {s.name: s.iopolicy for s in new.subsystems.values()}
    crows, nrows, hrows = [], [], []
    if old is None:
        for c in new.controllers.values():
            crows.append(ctrl_row(c, ts_ns, "snapshot", iop.get(c.subsystem, "")))
            for ns in c.namespaces:
                nrows.append(ns_row(ns, c, ts_ns, "snapshot"))
                hrows.extend(hctx_rows(ns, ts_ns))
        return crows, nrows, hrows
    for inst in sorted(set(old.controllers) | set(new.controllers)):
        a, c = old.controllers.get(inst), new.controllers.get(inst)
        if c is None:
            crows.append(ctrl_row(a, ts_ns, "vanished", ""))
            nrows.extend(ns_row(ns, a, ts_ns, "vanished") for ns in a.namespaces)
            continue
        if a is None:
            crows.append(ctrl_row(c, ts_ns, "appeared", iop.get(c.subsystem, "")))
            for ns in c.namespaces:
                nrows.append(ns_row(ns, c, ts_ns, "appeared"))
                hrows.extend(hctx_rows(ns, ts_ns))
            continue
        if any(getattr(a, k) != getattr(c, k) for k in CTRL_KEYS):
            crows.append(ctrl_row(c, ts_ns, "changed", iop.get(c.subsystem, "")))
        olds = {ns.disk: ns for ns in a.namespaces}
        news = {ns.disk: ns for ns in c.namespaces}
        for disk in sorted(set(olds) | set(news)):
            o, n = olds.get(disk), news.get(disk)
            if n is None:
                nrows.append(ns_row(o, a, ts_ns, "vanished"))
            elif o is None:
                nrows.append(ns_row(n, c, ts_ns, "appeared"))
                hrows.extend(hctx_rows(n, ts_ns))
            elif any(getattr(o, k) != getattr(n, k) for k in NS_KEYS):
                nrows.append(ns_row(n, c, ts_ns, "changed"))
    return crows, nrows, hrows
