"""NIC counter batches turned into ``nic_counters`` rows: per-counter delta state and the rules
of ``kvtrace.fabric.counterspec.step()`` applied to whole batches with numpy."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa

from kvtrace.dataset import schema
from kvtrace.fabric.counterspec import U32, Batch

TABLE = "nic_counters"
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


def total(cols_or_table, **match) -> int:
    """Sum of ``delta`` over rows matching ``match`` (a helper for tests and reports)."""
    t = cols_or_table if isinstance(cols_or_table, pa.Table) else to_table(cols_or_table)
    mask = np.ones(t.num_rows, dtype=bool)
    for k, v in match.items():
        mask &= np.array([x == v for x in t[k].to_pylist()], dtype=bool)
    deltas = [d for d, m in zip(t["delta"].to_pylist(), mask) if m and d is not None]
    return int(sum(deltas))
