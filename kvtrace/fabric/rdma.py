"""RDMA port counters and hw_counters from sysfs (``/sys/class/infiniband``): the reader the
NIC poller (kvtrace.fabric.counters) polls, and the device listing `kvtrace doctor` shows."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np

from kvtrace.fabric.counterspec import HW_SKIP, U64, Batch, Spec, hw_spec, pma_spec

IB_CLASS = "/sys/class/infiniband"


class RdmaCounters:
    """Every RDMA device's port counters and hw_counters under ``root`` (sysfs), read with
    one pread per file per poll (sysfs re-runs show() on a read at offset 0, so files stay
    open); devices and ports are rediscovered every ``rescan`` polls, and at once when a
    device directory disappears or a read says the attribute is gone."""

    def __init__(self, root: str = "/", rescan: int = 100):
        self.root = root
        self.rescan = rescan
        self.devices: dict[str, dict] = {}
        self.keys: list[tuple] = []
        self.specs: list[Spec] = []
        self.netdevs: list[str] = []
        self.paths: list[str] = []
        self.fds: list[int] = []
        self.polls = 0
        self._dev_dirs: list[str] = []

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, rel.lstrip("/"))

    def _listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(rel)))
        except OSError:
            return []

    def _read(self, rel: str) -> str:
        try:
            with open(self._p(rel)) as f:
                return f.read().strip()
        except OSError:
            return ""

    def _driver(self, dev: str) -> str:
        try:
            drv = os.path.basename(os.path.realpath(self._p(f"{IB_CLASS}/{dev}/device/driver")))
        except OSError:
            drv = ""
        if drv.startswith("mlx5") or dev.startswith("mlx5"):
            return "mlx5"
        if dev.startswith("rxe") or drv.startswith("rdma_rxe"):
            return "rxe"
        if dev.startswith("siw"):
            return "siw"
        return drv or dev.rstrip("0123456789_")

    def _netdev(self, dev: str, port: int) -> str:
        nd = self._read(f"{IB_CLASS}/{dev}/ports/{port}/gid_attrs/ndevs/0")
        if nd and nd != "N/A":
            return nd
        nets = self._listdir(f"{IB_CLASS}/{dev}/device/net")
        return ",".join(nets) or self._read(f"{IB_CLASS}/{dev}/parent")

    def discover(self) -> None:
        found: list[tuple] = []
        devices = {}
        for dev in self._listdir(IB_CLASS):
            drv = self._driver(dev)
            ports = sorted(int(p) for p in self._listdir(f"{IB_CLASS}/{dev}/ports") if p.isdigit())
            devices[dev] = {"driver": drv, "ports": {}}
            for name in self._listdir(f"{IB_CLASS}/{dev}/hw_counters"):
                if name not in HW_SKIP:
                    found.append((("ib_hw_counters", dev, 0, name), hw_spec(name, drv), "", f"{IB_CLASS}/{dev}/hw_counters/{name}"))
            for port in ports:
                base = f"{IB_CLASS}/{dev}/ports/{port}"
                netdev = self._netdev(dev, port)
                devices[dev]["ports"][port] = {
                    "netdev": netdev, "link_layer": self._read(f"{base}/link_layer"),
                    "state": self._read(f"{base}/state"), "rate": self._read(f"{base}/rate")}
                names = self._listdir(f"{base}/counters")
                ext = "unicast_xmit_packets" in names or "unicast_rcv_packets" in names
                for name in names:
                    found.append((("ib_counters", dev, port, name), pma_spec(name, ext), netdev, f"{base}/counters/{name}"))
                for name in self._listdir(f"{base}/hw_counters"):
                    if name not in HW_SKIP:
                        found.append((("ib_hw_counters", dev, port, name), hw_spec(name, drv), netdev, f"{base}/hw_counters/{name}"))
        old = dict(zip(self.keys, self.fds))
        keys, specs, netdevs, paths, fds = [], [], [], [], []
        for key, spec, netdev, rel in found:
            fd = old.pop(key, -1)
            if fd < 0:
                try:
                    fd = os.open(self._p(rel), os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    fd = -1
            keys.append(key)
            specs.append(spec)
            netdevs.append(netdev)
            paths.append(rel)
            fds.append(fd)
        for fd in old.values():
            if fd >= 0:
                os.close(fd)
        self.keys, self.specs, self.netdevs, self.paths, self.fds = keys, specs, netdevs, paths, fds
        self.devices = devices
        self._dev_dirs = [self._p(f"{IB_CLASS}/{d}") for d in devices]

    def poll(self) -> Batch:
        isdir = os.path.isdir
        if self.polls % self.rescan == 0 or not all(isdir(d) for d in self._dev_dirs):
            self.discover()
        self.polls += 1
        raws: list[int] = []
        append = raws.append
        errors: dict[int, str] = {}
        pread = os.pread
        for i, fd in enumerate(self.fds):
            try:
                data = pread(fd, 64, 0)
                v = int(data)                # int() takes b"123\n"
                if 0 <= v < U64:
                    append(v)
                    continue
                errors[i] = "garbage: " + data.decode("ascii", "replace").strip()[:40]
            except ValueError:
                errors[i] = "garbage: " + data.decode("ascii", "replace").strip()[:40]
            except OSError as e:
                if fd < 0:   # could not be opened at discovery: try again
                    v, why = self._reopen(i)
                    if v is not None:
                        append(v)
                        continue
                    errors[i] = why
                else:
                    errors[i] = e.strerror or str(e)
                    if e.errno in (2, 19):  # ENOENT/ENODEV: the attribute is gone; rediscover next poll
                        self.polls = 0
            append(0)
        vals = np.array(raws, dtype=np.uint64)
        ok = np.ones(len(raws), dtype=bool)
        if errors:
            ok[list(errors)] = False
        return Batch(self.keys, self.specs, self.netdevs, vals, ok, errors, ("rdma",))

    def _reopen(self, i: int) -> tuple[int | None, str]:
        try:
            fd = self.fds[i] = os.open(self._p(self.paths[i]), os.O_RDONLY | os.O_CLOEXEC)
            v = int(os.pread(fd, 64, 0))
            return (v, "") if 0 <= v < U64 else (None, "garbage")
        except (OSError, ValueError) as e:
            return None, getattr(e, "strerror", None) or str(e)

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.keys, self.specs, self.netdevs, self.paths, self.fds = [], [], [], [], []


def ib_devices(root: str = "/") -> dict[str, dict]:
    """RDMA devices: driver, ports (netdev, link layer, state, rate, how many counters and
    hw_counters each) and device-level hw_counters, for `kvtrace doctor`."""
    r = RdmaCounters(root)
    r.discover()
    out = {}
    for dev, info in r.devices.items():
        n = Counter((k[0], k[2]) for k in r.keys if k[1] == dev)
        ports = {}
        for port, p in info["ports"].items():
            ports[port] = {**p, "counters": n.get(("ib_counters", port), 0), "hw_counters": n.get(("ib_hw_counters", port), 0)}
        out[dev] = {"driver": info["driver"], "ports": ports, "hw_counters": n.get(("ib_hw_counters", 0), 0)}
    r.close()
    return out


def rdma_netdevs(root: str = "/") -> list[str]:
    out = []
    for info in ib_devices(root).values():
        for p in info["ports"].values():
            for nd in (p.get("netdev") or "").split(","):
                if nd and nd not in out:
                    out.append(nd)
    return out
