"""Netdev counters through pyroute2: ``ethtool -S`` statistics (IoctlEthtool) and link stats64
(netlink), the readers the NIC poller (kvtrace.fabric.counters) polls."""
from __future__ import annotations

from kvtrace.fabric.counterspec import Batch, Spec, make_batch


def ethtool_unit(name: str) -> str:
    n = name.lower()
    if "bytes" in n:
        return "bytes"
    if "packets" in n or "pkts" in n or n.endswith("_pause"):
        return "packets"
    if "duration" in n:
        return "us"
    return "events"


class EthtoolStats:
    """``ethtool -S`` of each interface through pyroute2's IoctlEthtool (SIOCETHTOOL).

    IoctlEthtool caches the statistic names; when a driver changes its string set (mlx5
    does when PFC is enabled on a priority) the handle is made again."""

    def __init__(self, ifnames: list[str]):
        self.ifnames = list(ifnames)
        self._eth: dict[str, object] = {}
        self.unsupported: dict[str, str] = {}
        self._specs: dict[str, Spec] = {}

    def _get(self, ifname):
        from pyroute2.ethtool.ioctl import IoctlEthtool

        e = self._eth.get(ifname)
        if e is None:
            e = IoctlEthtool(ifname)
            self._eth[ifname] = e
        return e

    def _spec(self, name: str) -> Spec:
        sp = self._specs.get(name)
        if sp is None:
            sp = self._specs[name] = Spec(64, 1, ethtool_unit(name))
        return sp

    def poll(self) -> list[Batch]:
        out = []
        for ifname in self.ifnames:
            if ifname in self.unsupported:
                continue
            try:
                stats = self._get(ifname).get_statistics()
            except Exception as e:  # not supported, the string set changed, the device went away
                self._drop(ifname)
                if "NotSupported" in type(e).__name__:
                    self.unsupported[ifname] = "ethtool statistics not supported"
                    continue
                try:
                    stats = self._get(ifname).get_statistics()
                except Exception as e2:
                    self._drop(ifname)
                    b = make_batch("ethtool", ifname, [], ifname)
                    b.failed = [("ethtool", ifname, f"{type(e2).__name__}: {e2}"[:80])]
                    out.append(b)
                    continue
            out.append(make_batch("ethtool", ifname, [(n, v, self._spec(n)) for n, v in stats], ifname))
        return out

    def _drop(self, ifname):
        e = self._eth.pop(ifname, None)
        if e is not None:
            try:
                e.close()
            except Exception:
                pass

    def close(self) -> None:
        for ifname in list(self._eth):
            self._drop(ifname)


LINK_UNITS = {"rx_bytes": "bytes", "tx_bytes": "bytes", "rx_packets": "packets", "tx_packets": "packets",
              "multicast": "packets"}


class LinkStats:
    """Link stats64 (IFLA_STATS64) of each interface through pyroute2 netlink (one dump per poll)."""

    def __init__(self, ifnames: list[str]):
        self.ifnames = set(ifnames)
        self._ipr = None
        self.ifindex: dict[str, int] = {}
        self._specs = {k: Spec(64, 1, v) for k, v in LINK_UNITS.items()}

    def poll(self) -> list[Batch]:
        from pyroute2 import IPRoute

        if self._ipr is None:
            self._ipr = IPRoute()
        out, seen = [], set()
        try:
            links = self._ipr.get_links()
        except Exception as e:
            b = make_batch("link", "", [])
            b.failed = [("link", n, f"netlink: {e}"[:80]) for n in sorted(self.ifnames)]
            return [b]
        failed = []
        for link in links:
            name = link.get_attr("IFLA_IFNAME")
            if name not in self.ifnames:
                continue
            seen.add(name)
            idx = link["index"]
            if self.ifindex.get(name, idx) != idx:
                failed.append(("link", name, "re-created"))
            self.ifindex[name] = idx
            stats = link.get_attr("IFLA_STATS64") or {}
            items = [(k, v, self._specs.get(k) or Spec(64, 1, "packets" if "packets" in k else "events")) for k, v in stats.items()]
            out.append(make_batch("link", name, items, name, ("link", name, idx)))
        for name in sorted(self.ifnames - seen):
            failed.append(("link", name, "no such interface"))
        if failed:
            b = make_batch("link", "", [])
            b.failed = failed
            out.append(b)
        return out

    def close(self) -> None:
        if self._ipr is not None:
            try:
                self._ipr.close()
            except Exception:
                pass
            self._ipr = None
