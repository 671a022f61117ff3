"""NIC and RDMA counters, polled: RDMA port counters and hw_counters from sysfs, ethtool
statistics (pyroute2's IoctlEthtool) and link stats64 (pyroute2 netlink), turned into deltas.

Units and widths (drivers/infiniband/core/sysfs.c, hw/mlx5/counters.c, sw/rxe/rxe_hw_counters.c):

* ``ports/N/counters/port_{xmit,rcv}_data`` count 4-byte words: kvtrace multiplies by 4.
  The PMA error counters are 16, 8 or 4 bits wide and *saturate* (stop at all ones); the
  data/packet counters are 32 bits (saturating) or 64 bits with the extended PMA set.
* mlx5 ``hw_counters`` from Q counters (out_of_sequence, packet_seq_err,
  local_ack_timeout_err, ...) are 32-bit and *wrap*; congestion counters (np_cnp_sent,
  rp_cnp_handled, np_ecn_marked_roce_packets, ...) are 64-bit.  rxe counters are 64-bit.
* ethtool and link stats64 counters are 64-bit.

A delta is never negative: a 32-bit wrapping counter that went down wrapped (delta across
the wrap); a 64-bit counter that went down was reset (device re-created, counters cleared):
no delta, status ``reset``, the new value is the baseline.  Unreadable or non-numeric
values (``N/A (no PMA)``, EIO while the device resets) give status ``garbage``/``error`` and
keep the last good value as the baseline.  A device or counter that disappears gives
``vanished`` rows; one that appears, ``first`` rows.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrace.dataset import schema

TABLE = "nic_counters"
U32, U64 = 1 << 32, 1 << 64
IB_CLASS = "/sys/class/infiniband"


@dataclass(frozen=True)
class Spec:
    width: int = 64            # bits; 0 = unknown (32-bit wrap inferred when plausible)
    scale: int = 1             # raw -> value multiplier (4 for 4-byte words)
    unit: str = "events"
    saturating: bool = False   # stops at all ones instead of wrapping (IB PMA counters)
    wraps: bool = False        # a decrease is a wrap at ``width`` (not a reset)


# ib core PMA counters (ports/N/counters): (width of the basic set, unit)
PMA = {
    "symbol_error": (16, "events"), "link_error_recovery": (8, "events"), "link_downed": (8, "events"),
    "port_rcv_errors": (16, "packets"), "port_rcv_remote_physical_errors": (16, "packets"),
    "port_rcv_switch_relay_errors": (16, "packets"), "port_xmit_discards": (16, "packets"),
    "port_xmit_constraint_errors": (8, "packets"), "port_rcv_constraint_errors": (8, "packets"),
    "local_link_integrity_errors": (4, "events"), "excessive_buffer_overrun_errors": (4, "events"),
    "VL15_dropped": (16, "packets"), "port_xmit_wait": (32, "ticks"),
    "port_xmit_data": (32, "bytes"), "port_rcv_data": (32, "bytes"),
    "port_xmit_packets": (32, "packets"), "port_rcv_packets": (32, "packets"),
    "unicast_xmit_packets": (64, "packets"), "unicast_rcv_packets": (64, "packets"),
    "multicast_xmit_packets": (64, "packets"), "multicast_rcv_packets": (64, "packets"),
}
PMA_EXT = {"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets"}
WORDS = {"port_xmit_data", "port_rcv_data"}   # 4-byte words
# mlx5 Q counters: 32-bit, wrap (be32 from QUERY_Q_COUNTER)
MLX5_Q32 = {
    "rx_write_requests", "rx_read_requests", "rx_atomic_requests", "rx_dct_connect", "out_of_buffer",
    "out_of_sequence", "duplicate_request", "rnr_nak_retry_err", "packet_seq_err", "implied_nak_seq_err",
    "local_ack_timeout_err", "resp_local_length_error", "resp_cqe_error", "req_cqe_error",
    "req_remote_invalid_request", "req_remote_access_errors", "resp_remote_access_errors",
    "resp_cqe_flush_error", "req_cqe_flush_error", "req_transport_retries_exceeded", "req_rnr_retries_exceeded",
    "roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps",
    "roce_slow_restart_trans",
}
HW_BYTES = {"rdma_tx_bytes", "rdma_rx_bytes"}
HW_PACKETS = {"sent_pkts", "rcvd_pkts", "rdma_tx_packets", "rdma_rx_packets", "np_ecn_marked_roce_packets",
              "cc_rx_ce_pkts", "cc_rx_cnp_pkts", "cc_tx_cnp_pkts", "rx_icrc_encapsulated"}
HW_SKIP = {"lifespan"}   # a setting, not a counter


def pma_spec(name: str, ext: bool) -> Spec:
    width, unit = PMA.get(name, (0, "events"))
    if name in PMA_EXT:
        # 64-bit with the extended set; without unicast_* it is the basic set (32-bit,
        # saturating) or the extended set without IETF counters (64-bit): width unknown
        width = 64 if ext else 0
    return Spec(width=width, scale=4 if name in WORDS else 1, unit=unit, saturating=0 < width < 64)


def hw_spec(name: str, driver: str) -> Spec:
    unit = "bytes" if name in HW_BYTES else "packets" if name in HW_PACKETS else "events"
    if name.startswith("vport_") and name[6:] in MLX5_Q32:
        name = name[6:]
    if driver == "mlx5" and name in MLX5_Q32:
        return Spec(width=32, unit=unit, wraps=True)
    if driver in ("mlx5", "rxe", "siw"):
        return Spec(width=64, unit=unit)
    return Spec(width=0, unit=unit)


def step(prev: int | None, cur: int | None, spec: Spec) -> tuple[int | None, str]:
    """(raw delta or None, status) from the previous good raw value to this read."""
    if cur is None or (0 < spec.width < 64 and cur >> spec.width):
        return None, "garbage"   # unreadable, or more bits than the counter has
    if prev is None:
        return None, "first"
    if cur >= prev:
        if spec.saturating and cur == (1 << spec.width) - 1:
            return cur - prev, "saturated"
        return cur - prev, "ok"
    if spec.saturating:
        return None, "reset"
    if spec.wraps and spec.width < 64:
        return cur + (1 << spec.width) - prev, "wrap"
    if spec.width == 0 and prev < U32 and cur + U32 - prev <= U32 // 2:
        return cur + U32 - prev, "wrap"
    return None, "reset"


def parse_value(data: bytes | str | None) -> int | None:
    """A counter file's content to an unsigned integer, None when it is not one."""
    if data is None:
        return None
    if isinstance(data, bytes):
        data = data.decode("ascii", "replace")
    text = data.strip()
    if not text or not text.isdigit():
        return None
    v = int(text)
    return v if v < U64 else None


@dataclass
class Batch:
    """One source's reads of one poll, aligned with ``keys`` (source, device, port, name).

    ``keys``/``specs``/``netdevs`` stay the same objects from poll to poll until the source
    rediscovers its counters, so the delta state is realigned only then."""

    keys: list[tuple]
    specs: list[Spec]
    netdevs: list[str]
    vals: np.ndarray           # uint64 raw values
    ok: np.ndarray             # bool: the read gave a number
    errors: dict[int, str]     # index -> why not (garbage text, OS error)
    group: tuple = ()          # whose counters these are (delta state is kept per group)
    failed: list[tuple] = None  # (source, device, why): a whole device/interface unreadable


def make_batch(source: str, device: str, items, netdev: str = "", group: tuple = ()) -> Batch:
    """A batch from (name, value, Spec) items (ethtool, link): value None = unreadable."""
    keys, specs, vals, ok, errors = [], [], [], [], {}
    for i, (name, value, spec) in enumerate(items):
        keys.append((source, device, 0, name))
        specs.append(spec)
        good = isinstance(value, int) and 0 <= value < U64
        vals.append(value if good else 0)
        ok.append(good)
        if not good:
            errors[i] = "garbage"
    return Batch(keys, specs, [netdev] * len(keys), np.array(vals, dtype=np.uint64), np.array(ok, dtype=bool), errors,
                 group or (source, device))


# ---- RDMA sysfs ---------------------------------------------------------------------------------
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


# ---- netdevs: pyroute2 -----------------------------------------------------------------------
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


# ---- deltas --------------------------------------------------------------------------------------
COLS = ("ts_ns", "interval_ns", "source", "device", "port", "netdev", "name", "raw", "value", "delta", "unit",
        "status", "rate", "full")
ST_OK, ST_FIRST, ST_GARBAGE, ST_ERROR, ST_WRAP, ST_RESET, ST_SAT = range(7)
STATUS = ["ok", "first", "garbage", "error", "wrap", "reset", "saturated"]


class _State:
    __slots__ = ("keys", "prev", "has", "ts", "width", "scale", "wraps", "sat", "units", "netdevs")

    def __init__(self, b: Batch):
        n = len(b.keys)
        self.keys = b.keys
        self.prev = np.zeros(n, dtype=np.uint64)
        self.has = np.zeros(n, dtype=bool)
        self.ts = np.zeros(n, dtype=np.int64)
        self.width = np.array([s.width for s in b.specs], dtype=np.int64)
        self.scale = np.array([s.scale for s in b.specs], dtype=np.uint64)
        self.wraps = np.array([s.wraps and 0 < s.width < 64 for s in b.specs], dtype=bool)
        self.sat = np.array([s.saturating and 0 < s.width < 64 for s in b.specs], dtype=bool)
        self.units = [s.unit for s in b.specs]
        self.netdevs = b.netdevs


class Deltas:
    """Per-counter state (last good raw value and when it was read) and the delta rules of
    ``step()``, applied to whole batches with numpy.  State is kept per batch group (all
    RDMA counters; one interface's ethtool or link stats); when a group's key list is
    rebuilt, matching counters carry their baseline over and the others are ``vanished``."""

    def __init__(self):
        self.states: dict[tuple, _State] = {}

    def _vanish(self, st: _State, idx, ts_ns, full, cols, counts) -> None:
        for i in idx:
            source, device, port, name = st.keys[i]
            counts["vanished"] += 1
            _append(cols, ts_ns, int(ts_ns - st.ts[i]) if st.has[i] else 0, source, device, port, st.netdevs[i], name,
                    None, None, None, st.units[i], "vanished", None, full)

    def rows(self, batches: list[Batch], ts_ns: int, full: bool, cols: dict[str, list]) -> Counter:
        counts = Counter()
        failed = set()
        for b in batches:
            for source, device, why in b.failed or ():
                failed.add((source, device))
                counts["error"] += 1
                _append(cols, ts_ns, 0, source, device, 0, device, why, None, None, None, "", "error", None, full)
            if not b.group:
                continue
            st = self.states.get(b.group)
            if st is None or st.keys is not b.keys:
                new = _State(b)
                if st is not None:
                    index = {k: j for j, k in enumerate(b.keys)}
                    gone = []
                    for i, k in enumerate(st.keys):
                        j = index.get(k)
                        if j is None:
                            gone.append(i)
                        elif st.has[i]:
                            new.prev[j], new.has[j], new.ts[j] = st.prev[i], True, st.ts[i]
                    self._vanish(st, gone, ts_ns, full, cols, counts)
                self.states[b.group] = st = new
            self._rows(b, st, ts_ns, full, cols, counts)
        groups = {b.group for b in batches}
        for g in list(self.states):
            if g not in groups and g[:2] in failed:  # an interface that went away or was re-created
                st = self.states.pop(g)
                self._vanish(st, range(len(st.keys)), ts_ns, full, cols, counts)
        return counts

    def _rows(self, b: Batch, st: _State, ts_ns: int, full: bool, cols, counts: Counter) -> None:
        cur, prev, has = b.vals, st.prev, st.has
        narrow = (st.width > 0) & (st.width < 64)
        too_wide = narrow & ((cur >> np.where(narrow, st.width, 0).astype(np.uint64)) != 0)
        ok = b.ok & ~too_wide   # more bits than the counter has: garbage
        both = ok & has
        with np.errstate(over="ignore"):
            diff = cur - prev                                   # mod 2^64
        up = both & (cur >= prev)
        down = both & (cur < prev)
        mask32 = np.uint64(U32 - 1)
        wrap = down & st.wraps
        guess = down & (st.width == 0) & (prev < np.uint64(U32)) & ((diff & mask32) <= np.uint64(U32 // 2))
        delta = np.where(up, diff, np.uint64(0))
        delta = np.where(wrap | guess, diff & mask32, delta)   # only 32-bit counters wrap
        status = np.full(len(cur), ST_OK, dtype=np.int8)
        status[~ok] = ST_GARBAGE
        status[ok & ~has] = ST_FIRST
        status[wrap | guess] = ST_WRAP
        status[down & ~(wrap | guess)] = ST_RESET
        satmax = np.where(st.sat, (np.uint64(1) << st.width.astype(np.uint64)) - np.uint64(1), np.uint64(0))
        status[up & st.sat & (cur == satmax)] = ST_SAT
        for i, why in b.errors.items():
            if not why.startswith("garbage"):
                status[i] = ST_ERROR
        has_delta = up | wrap | guess
        # quiet: ok with no change, and saturated counters that stay saturated
        quiet = ((status == ST_OK) | (status == ST_SAT)) & (delta == 0)
        emit = np.ones(len(cur), dtype=bool) if full else ~quiet
        interval = np.where(has, ts_ns - st.ts, 0)
        for code, n in enumerate(np.bincount(status, minlength=len(STATUS)).tolist()):
            if n:
                counts[STATUS[code]] += n
        for i in np.flatnonzero(emit).tolist():
            source, device, port, name = b.keys[i]
            sc = int(st.scale[i])
            raw = int(cur[i]) if ok[i] else None
            d = int(delta[i]) * sc if has_delta[i] else None
            iv = int(interval[i])
            rate = d / (iv / 1e9) if d is not None and iv > 0 else None
            _append(cols, ts_ns, iv, source, device, port, b.netdevs[i], name, raw,
                    raw * sc if raw is not None else None, d, st.units[i], STATUS[status[i]], rate, full)
        # the new baseline: every good read
        st.prev = np.where(ok, cur, prev)
        st.ts = np.where(ok, ts_ns, st.ts)
        st.has = has | ok


def _append(cols, ts_ns, interval, source, device, port, netdev, name, raw, value, delta, unit, status, rate, full):
    cols["ts_ns"].append(ts_ns)
    cols["interval_ns"].append(interval)
    cols["source"].append(source)
    cols["device"].append(device)
    cols["port"].append(port)
    cols["netdev"].append(netdev)
    cols["name"].append(name)
    cols["raw"].append(raw)
    cols["value"].append(value)
    cols["delta"].append(delta)
    cols["unit"].append(unit)
    cols["status"].append(status)
    cols["rate"].append(rate)
    cols["full"].append(full)


def to_table(cols: dict[str, list]) -> pa.Table:
    sch = schema.TABLES[TABLE]
    return pa.table({c: pa.array(cols[c], sch.field(c).type) for c in sch.names}, schema=sch)


def _setns(netns: str) -> None:
    """Move the calling thread into a named network namespace (/run/netns/NAME)."""
    import ctypes

    path = netns if netns.startswith("/") else f"/run/netns/{netns}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NicPoller:
    """A pipeline sidecar: polls RDMA counters and ethtool statistics every ``interval``
    seconds and link stats64 every ``link_interval`` seconds on its own thread, and hands
    their rows over per flush (``drain``).  (A netlink request costs about 0.3 ms of CPU per
    interface in pyroute2, sysfs about 1.5 us per counter: link stats are polled less often.)

    Rows are written for counters that moved or changed status; every ``full_every``
    seconds (and at the first and last poll) every counter is written (``full``), so sums of
    deltas over any window are exact and the absolute values are never far away.
    """

    name = TABLE

    def __init__(self, interval: float = 0.1, rdma: bool = True, ifaces: list[str] | None = None,
                 ethtool: bool = True, link: bool = True, netns: str | None = None, root: str = "/",
                 full_every: float = 10.0, link_interval: float = 1.0, max_queue: int = 100000):
        if interval <= 0 or link_interval <= 0:
            raise ValueError("intervals must be positive")
        self.interval = interval
        self.link_every = max(1, round(link_interval / interval))
        self.netns = netns
        self.full_every = full_every
        self.rdma = RdmaCounters(root) if rdma else None
        self.ifaces = list(ifaces or [])
        self.eth = EthtoolStats(self.ifaces) if ethtool and self.ifaces else None
        self.link = LinkStats(self.ifaces) if link and self.ifaces else None
        self.deltas = Deltas()
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.c = Counter()
        self.cpu_s = 0.0
        self.last_full = 0
        self.error: str | None = None

    def poll_once(self, full: bool | None = None) -> None:
        t0 = time.thread_time()
        ts = time.monotonic_ns()
        if full is None:
            full = self.c["polls"] == 0 or ts - self.last_full >= self.full_every * 1e9
        if full:
            self.last_full = ts
        batches: list[Batch] = []
        if self.rdma is not None:
            batches.append(self.rdma.poll())
        if self.eth is not None:
            batches.extend(self.eth.poll())
        if self.link is not None and (full or self.c["polls"] % self.link_every == 0):
            batches.extend(self.link.poll())
        cols = {c: [] for c in COLS}
        counts = self.deltas.rows(batches, ts, full, cols)
        with self._lock:
            self.c["polls"] += 1
            self.c["samples"] += sum(len(b.keys) for b in batches)
            self.c["rows"] += len(cols["ts_ns"])
            for k in ("wrap", "reset", "garbage", "error", "vanished", "saturated"):
                self.c["status_" + k] += counts.get(k, 0)
            self.cpu_s += time.thread_time() - t0
        if cols["ts_ns"]:
            try:
                self._q.put_nowait(cols)
            except queue.Full:
                self.c["queue_drops"] += 1

    def start(self) -> list[str]:
        """Poll once now (so a bad interface or netns is reported at once), then the thread."""
        warnings = []
        ready = threading.Event()

        def run():
            try:
                if self.netns:
                    _setns(self.netns)
                self.poll_once(full=True)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
            ready.set()
            if self.error:
                return
            nxt = time.monotonic() + self.interval
            while not self._stop.wait(max(0.0, nxt - time.monotonic())):
                try:
                    self.poll_once()
                except Exception as e:  # never take capture down
                    self.c["internal_errors"] += 1
                    self.error = f"{type(e).__name__}: {e}"
                nxt += self.interval
                if nxt < time.monotonic():
                    self.c["late"] += 1
                    nxt = time.monotonic() + self.interval
            try:
                self.poll_once(full=True)   # the end state, complete
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
            self._close_readers()

        self._thread = threading.Thread(target=run, name="kvtrace-nic", daemon=True)
        self._thread.start()
        ready.wait(30)
        if self.error:
            warnings.append(f"NIC counters: {self.error}")
        for ifname, why in (self.eth.unsupported.items() if self.eth else ()):
            warnings.append(f"NIC counters: {ifname}: {why}")
        return warnings

    def _close_readers(self) -> None:
        for r in (self.rdma, self.eth, self.link):
            if r is not None:
                r.close()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    stop = close

    def drain(self) -> dict[str, pa.Table]:
        cols = {c: [] for c in COLS}
        while True:
            try:
                chunk = self._q.get_nowait()
            except queue.Empty:
                break
            for c in COLS:
                cols[c].extend(chunk[c])
        return {TABLE: to_table(cols)} if cols["ts_ns"] else {}

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.c)
            out.update(interval_s=self.interval, link_interval_s=self.interval * self.link_every, cpu_s=round(self.cpu_s, 4), netns=self.netns, ifaces=self.ifaces,
                       rdma_devices=sorted(self.rdma.devices) if self.rdma else [], error=self.error)
        return out

    def lost(self) -> int:
        return self.c["queue_drops"]


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


def total(cols_or_table, **match) -> int:
    """Sum of ``delta`` over rows matching ``match`` (a helper for tests and reports)."""
    t = cols_or_table if isinstance(cols_or_table, pa.Table) else to_table(cols_or_table)
    mask = np.ones(t.num_rows, dtype=bool)
    for k, v in match.items():
        mask &= np.array([x == v for x in t[k].to_pylist()], dtype=bool)
    deltas = [d for d, m in zip(t["delta"].to_pylist(), mask) if m and d is not None]
    return int(sum(deltas))
