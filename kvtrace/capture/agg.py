"""In-kernel aggregation and raw-event sampling for the high-rate probes (blockio, fileio,
iouring), read once per flush (a pipeline sidecar):

    agg_stats (kind block)  -> block_agg        per (pid, device, op): requests, bytes, errors,
                                                 latency, queue and device time sums
    agg_hist  (kind block)  -> block_agg_hist   per (pid, device, op): log2 latency buckets
    agg_stats (kind fileio) -> file_agg         per (pid, system call): calls, bytes, errors,
                                                 bytes asked for, latency sum
    agg_hist  (kind fileio) -> file_agg_hist
    agg_stats (kind uring)  -> uring_agg        per (pid, opcode): completions, bytes, errors,
                                                 latency sum
    agg_hist  (kind uring)  -> uring_agg_hist

The kernel counts every event in these maps before it reserves ring-buffer space, so they are
exact at any rate; rows hold what changed since the previous flush, so a table's sums are the
run's totals.  The raw tables (block_io, file_io, io_uring) may be sampled: each row carries
the ``weight`` (events it stands for).

Sampling (``--sampling auto|off|N``): in auto mode the kernel raises a kind's sampling shift
the moment a reserve fails (probes/kvtrace.h), and this sidecar lowers it one step at a time
once failures have stopped for ``hold`` seconds (doubled each time a lowering brings failures
back, up to 60 s).  Switches are said on stderr and recorded in ``runs.sampling``.

The maps are read through the bcc table objects' ``items()``/``[]``, so tests give plain
Python objects and no bcc is imported here.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from kvtrace.capture import fileio, iouring, settle
from kvtrace.capture.events import KIND_BLOCK, KIND_FILEIO, KIND_URING, NKINDS, map_items as _items
from kvtrace.dataset import schema
from kvtrace.errors import UsageError

MAX_SHIFT = 15
TABLES = {KIND_BLOCK: "block_io", KIND_FILEIO: "file_io", KIND_URING: "io_uring"}
AGG = {KIND_BLOCK: "block_agg", KIND_FILEIO: "file_agg", KIND_URING: "uring_agg"}
PROBE_KIND = {"blockio": KIND_BLOCK, "fileio": KIND_FILEIO, "iouring": KIND_URING}
BLOCK_OPS = ["R", "W", "D", "F", "N"]
SFIELDS = ("count", "bytes", "errors", "latency_ns", "sum2", "sum3")
HOLD_S, MAX_HOLD_S = 2.0, 60.0
MAX_CHANGES = 200
SWEEP_EVERY = 10          # flushes between sweeps of the keys of exited processes


def parse_mode(text: str) -> str | int:
    """``auto``, ``off``, or N (keep 1 in N raw events; a power of two up to 2^15)."""

    t = str(text).strip().lower()
    if t in ("auto", "off"):
        return t
    try:
        n = int(t)
    except ValueError:
        n = 0
    if n < 1 or n & (n - 1) or n > 1 << MAX_SHIFT:
        raise UsageError(f"--sampling {text}: give auto, off, or N (keep 1 in N raw events; a power of two, 1..{1 << MAX_SHIFT})")
    return n


def _int(v) -> int:
    return int(getattr(v, "value", v))


def _percpu_sum(table, kind: int) -> int:
    try:
        v = table.getvalue(ctypes.c_int(kind))
    except Exception:
        v = table[ctypes.c_int(kind)]
    if isinstance(v, (list, tuple)) or hasattr(v, "__len__"):
        return sum(_int(x) for x in v)
    return _int(v)


@dataclass
class KindState:
    table: str
    shift: int = 0
    max_shift: int = 0
    lost: int = 0
    last_loss: float = -1e9
    last_raise: float = -1e9
    last_lower: float = -1e9
    hold: float = HOLD_S
    on_since: float | None = None
    sampled_s: float = 0.0
    raises: int = 0
    lowers: int = 0
    safe_rate: float = 10_000.0   # highest raw events/s the reader took without a loss (at least
                                  # this much: the reader decodes ~800k/s, see bench/capacity.py)
    changes: list = field(default_factory=list)
    changes_dropped: int = 0


class AggMaps:
    """Sidecar: the aggregation maps into rows, and the sampling controller."""

    name = "io_agg"

    def __init__(self, tables: dict, kinds: list[int], ctx=None, mode: str | int = "auto", echo=None,
                 clock=time.monotonic, root: str = "/"):
        self.t = tables          # agg_stats, agg_hist, agg_drops, sample_cfg, lost, lost_weight, block_start
        self.root = root
        self.pending: dict[str, pa.Table] = {}   # rows settled at the stop (kvtrace.capture.settle)
        self.kinds = [k for k in kinds if k in TABLES]
        self.ctx = ctx
        self.mode = mode
        self.echo = echo or (lambda m: None)
        self.clock = clock
        self.prev_s: dict[tuple, tuple] = {}
        self.prev_h: dict[tuple, int] = {}
        self.last_ns = time.monotonic_ns()
        self.last_s = clock()
        self.c = Counter()
        self.drops: dict[int, int] = {}   # agg_drops: events a full map could not count
        self.state = {k: KindState(TABLES[k]) for k in self.kinds}
        self.configure()

    # ---- sampling -------------------------------------------------------------------------
    def _cfg(self, kind: int):
        return self.t["sample_cfg"][ctypes.c_int(kind)]

    def _set_cfg(self, kind: int, shift: int, auto: bool, raises: int | None = None, expect: int | None = None) -> bool:
        """Write the kind's sampling settings; with ``expect``, only if the kernel has not moved
        the shift since it was read (a raise in between wins)."""
        cfg = self.t["sample_cfg"]
        old = cfg[ctypes.c_int(kind)]
        if expect is not None and int(old.shift) != expect:
            return False
        cfg[ctypes.c_int(kind)] = cfg.Leaf(shift=shift, auto_raise=1 if auto else 0, last_raise=time.monotonic_ns(),
                                           drained=1, raises=old.raises if raises is None else raises)
        return True

    def configure(self) -> None:
        if "sample_cfg" not in self.t:
            return
        shift = 0 if self.mode in ("auto", "off") else int(self.mode).bit_length() - 1
        now = self.clock()
        for k in self.kinds:
            self._set_cfg(k, shift, self.mode == "auto", raises=0)
            st = self.state[k]
            st.shift = st.max_shift = shift
            if shift:
                st.on_since = now
                self._change(st, shift, "fixed by --sampling")

    def _change(self, st: KindState, shift: int, why: str) -> None:
        if len(st.changes) < MAX_CHANGES:
            st.changes.append([time.monotonic_ns(), 1 << shift, why])
        else:
            st.changes_dropped += 1

    def control(self, counts: dict[int, int] | None = None, interval_s: float = 1.0) -> None:
        """Follow the kernel's raises, lower again when failures have stopped; say switches.

        ``counts``: events of each kind in the interval just ended (from the exact maps).  The
        highest raw-event rate the reader took without a loss is remembered; once quiet, the
        shift drops straight to what the current true rate needs at that rate (0 when a burst
        is over), else one step (probing upwards one flush at a time).
        """
        if "sample_cfg" not in self.t or self.mode != "auto":
            return
        now = self.clock()
        counts = counts or {}
        for k in self.kinds:
            st = self.state[k]
            try:
                cfg = self._cfg(k)
                lost = _percpu_sum(self.t["lost"], k) if "lost" in self.t else 0
            except Exception:
                self.c["cfg_errors"] += 1
                continue
            shift = min(int(cfg.shift), MAX_SHIFT)
            rate = counts.get(k, 0) / max(interval_s, 1e-3)
            if lost > st.lost:
                st.last_loss = now
            elif st.shift == shift:
                st.safe_rate = max(st.safe_rate, rate / (1 << shift))
            st.lost = lost
            if shift > st.shift:                        # raised in the kernel: the ring was full
                st.raises += shift - st.shift
                if now - st.last_lower <= 2 * st.hold:  # our last lowering brought failures back
                    st.hold = min(st.hold * 2, MAX_HOLD_S)
                was = st.shift
                st.shift, st.last_raise = shift, now
                st.max_shift = max(st.max_shift, shift)
                self._change(st, shift, "ring buffer full")
                if was == 0:
                    st.on_since = now
                    self.echo(f"kvtrace: {st.table}: ring buffer full ({lost:,} events lost so far): raw {st.table} rows "
                              f"now sampled 1 in {1 << shift}, each with its weight; {AGG[k]} stays exact")
                continue
            if not shift:
                continue
            # Lower one step once failures have stopped: for hold seconds after a raise, then for
            # about a flush interval at each level reached by lowering.
            quiet = now - max(st.last_loss, st.last_raise, st.last_lower)
            if quiet < (st.hold if st.last_raise >= st.last_lower else 0.9):
                continue
            need = 0
            while need < shift and rate / (1 << need) > st.safe_rate:
                need += 1
            new = min(shift - 1, need)
            try:
                if not self._set_cfg(k, new, True, expect=shift):
                    continue                            # raised meanwhile: seen next flush
            except Exception:
                self.c["cfg_errors"] += 1
                continue
            st.lowers += 1
            st.shift, st.last_lower = new, now
            self._change(st, new, "no losses")
            if new == 0 and st.on_since is not None:
                st.sampled_s += now - st.on_since
                st.on_since = None
                self.echo(f"kvtrace: {st.table}: the ring buffer keeps up again: every raw event kept (sampled for "
                          f"{st.sampled_s:.1f}s in all, at most 1 in {1 << st.max_shift})")

    def sampling(self) -> dict:
        """For runs.sampling: per raw table, the sampling now, the most it reached, each switch."""
        now = self.clock()
        out = {}
        for k in self.kinds:
            st = self.state[k]
            try:
                lost_w = _percpu_sum(self.t["lost_weight"], k) if "lost_weight" in self.t else 0
            except Exception:
                lost_w = 0
            out[st.table] = {
                "mode": self.mode, "n": 1 << st.shift, "max_n": 1 << st.max_shift,
                "sampled_s": round(st.sampled_s + (now - st.on_since if st.on_since is not None else 0), 3),
                "raises": st.raises, "lowers": st.lowers, "hold_s": st.hold, "lost_weight": lost_w,
                "changes": st.changes, "changes_dropped": st.changes_dropped,
                "agg_map_full": self.drops.get(k, 0) + self.drops.get(NKINDS + k, 0),
            }
        return out

    # ---- aggregates -----------------------------------------------------------------------
    def drain(self) -> dict[str, pa.Table]:
        now = time.monotonic_ns()
        interval = now - self.last_ns
        self.last_ns = now
        now_s = self.clock()
        interval_s, self.last_s = now_s - self.last_s, now_s
        rows = {AGG[k]: {c: [] for c in schema.TABLES[AGG[k]].names} for k in self.kinds}
        hist = {AGG[k] + "_hist": {c: [] for c in schema.TABLES[AGG[k] + "_hist"].names} for k in self.kinds}
        exited: list = []   # keys of processes that are gone, deleted once their last counts are read
        sweep = self.c["flushes"] % SWEEP_EVERY == SWEEP_EVERY - 1
        counts = self._drain_stats(rows, exited, sweep, now, interval)
        self._drain_hist(hist, exited, sweep, now, interval)
        self._sweep(exited)
        if "agg_drops" in self.t:
            drops = self.drops = {_int(k): _int(v) for k, v in _items(self.t["agg_drops"])}
            self.c["stats_map_full"] = sum(drops.get(k, 0) for k in self.kinds)
            self.c["hist_map_full"] = sum(drops.get(NKINDS + k, 0) for k in self.kinds)
        self.c["flushes"] += 1
        self.control(counts, interval_s)
        out, self.pending = self.pending, {}
        for name, cols in (*rows.items(), *hist.items()):
            if cols["ts_ns"]:
                sch = schema.TABLES[name]
                out[name] = pa.table({c: pa.array(cols[c], sch.field(c).type) for c in sch.names}, schema=sch)
        return out

    def _drain_stats(self, rows: dict, exited: list, sweep: bool, now: int, interval: int) -> Counter:
        """agg_stats since the last drain, as rows of each kind's aggregate table; events per kind."""
        counts = Counter()
        if "agg_stats" not in self.t:
            return counts
        for key, v in _items(self.t["agg_stats"]):
            kind = int(key.kind)
            if kind not in self.state:
                continue
            ident = (kind, int(key.tgid), int(key.dev), int(key.op))
            cur = tuple(int(getattr(v, f)) for f in SFIELDS)
            prev = self.prev_s.get(ident, (0,) * len(SFIELDS))
            d = dict(zip(SFIELDS, (max(0, a - b) for a, b in zip(cur, prev))))
            self.prev_s[ident] = cur
            if sweep and not any(d.values()) and not os.path.exists(f"/proc/{ident[1]}"):
                exited.append(("agg_stats", key, ident))   # idle for a flush, and its process gone
            if not d["count"]:
                continue
            r = rows[AGG[kind]]
            self._key_cols(r, kind, ident, now, interval)
            r["bytes"].append(d["bytes"])
            r["errors"].append(d["errors"])
            r["latency_sum_ns"].append(d["latency_ns"])
            if kind == KIND_BLOCK:
                r["requests"].append(d["count"])
                r["queue_sum_ns"].append(d["sum2"])
                r["device_sum_ns"].append(d["sum3"])
            elif kind == KIND_FILEIO:
                r["calls"].append(d["count"])
                r["requested"].append(d["sum2"])
            else:
                r["completions"].append(d["count"])
            self.c[f"{AGG[kind]}_events"] += d["count"]
            counts[kind] += d["count"]
        return counts

    def _drain_hist(self, hist: dict, exited: list, sweep: bool, now: int, interval: int) -> None:
        """agg_hist since the last drain, as rows of each kind's latency histogram table."""
        if "agg_hist" not in self.t:
            return
        for key, v in _items(self.t["agg_hist"]):
            kind = int(key.kind)
            if kind not in self.state:
                continue
            ident = (kind, int(key.tgid), int(key.dev), int(key.op), int(key.slot))
            cur = _int(v)
            dv = cur - self.prev_h.get(ident, 0)
            self.prev_h[ident] = cur
            if sweep and dv <= 0 and not os.path.exists(f"/proc/{ident[1]}"):
                exited.append(("agg_hist", key, ident))
            if dv <= 0:
                continue
            h = hist[AGG[kind] + "_hist"]
            self._key_cols(h, kind, ident, now, interval)
            slot = ident[4]
            h["slot"].append(slot)
            h["lo_ns"].append(1 << (slot - 1) if slot else 0)
            h["hi_ns"].append((1 << slot) - 1 if slot else 0)
            h["count"].append(dv)

    def _sweep(self, exited: list) -> None:
        for name, key, ident in exited:
            # everything the process did is in earlier rows: its keys can go, so a long capture of
            # many short-lived processes does not fill the maps (a reused pid starts from 0)
            try:
                del self.t[name][key]
            except Exception:
                continue
            (self.prev_s if name == "agg_stats" else self.prev_h).pop(ident, None)
            self.c["keys_swept"] += 1

    def _key_cols(self, r: dict, kind: int, ident: tuple, now: int, interval: int) -> None:
        _, pid, dev, op = ident[:4]
        r["ts_ns"].append(now)
        r["interval_ns"].append(interval)
        r["pid"].append(pid)
        if kind == KIND_BLOCK:
            r["dev_major"].append(dev >> 20)
            r["dev_minor"].append(dev & ((1 << 20) - 1))
            r["disk"].append(self.ctx.dev_name(dev) if self.ctx is not None else f"{dev >> 20}:{dev & ((1 << 20) - 1)}")
            r["op"].append(BLOCK_OPS[op] if op < len(BLOCK_OPS) else "N")
        elif kind == KIND_FILEIO:
            r["syscall"].append(fileio.SYSCALLS[op] if op < len(fileio.SYSCALLS) else "?")
        else:
            r["opcode"].append(op)
            r["op"].append(iouring.opname(op))

    def stats(self) -> dict:
        return {"sampling": str(self.mode), **self.c}

    def close(self) -> None:
        """At a clean stop, before the last flush (the probes still attached): block requests the
        probe still holds as issued, on a disk with nothing in flight, ended without their
        completion traced; the last flush writes them as block_io rows without latency
        (block_agg counts what the probe saw complete)."""
        if KIND_BLOCK not in self.state or "block_start" not in self.t or self.ctx is None:
            return
        try:
            ended, still = settle.block_requests(self.t["block_start"], self.ctx, self.root)
            rows = settle.block_rows(ended, time.monotonic_ns(), self.ctx)
        except Exception:
            self.c["settle_errors"] += 1
            return
        if rows is not None:
            self.pending["block_io"] = rows
        self.c["block_unseen_at_stop"] = len(ended)
        self.c["block_open_at_stop"] = still


def start(pipeline, source, mode: str | int = "auto", echo=None) -> AggMaps | None:
    """Add the aggregation sidecar for the attached high-rate probes and set their sampling."""
    kinds = [PROBE_KIND[p] for p in pipeline.plan.attached if p in PROBE_KIND]
    bpf = getattr(source, "bpf", None)
    if not kinds or bpf is None:
        return None
    tables = {}
    for n in ("agg_stats", "agg_hist", "agg_drops", "sample_cfg", "lost", "lost_weight", "block_start"):
        try:
            tables[n] = bpf[n]
        except Exception:
            pass
    side = AggMaps(tables, kinds, pipeline.ctx, mode, echo)
    pipeline.add_sidecar(side)
    return side
