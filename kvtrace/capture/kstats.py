"""The nvme and rdma probes' BPF maps, read once per flush into rows (a pipeline sidecar):

    nvme_qstats  -> nvme_queue       per (controller, queue, op class): setups, completions,
                                      bytes, errors, retried, unmatched, latency sum, SQ occupancy
    nvme_hist    -> nvme_queue_hist  per (controller, queue, op class): log2 latency buckets
    nvme_lbafix  -> (into nvme_queue's bytes) blocks of data commands on namespaces the probe
                                      did not know yet, counted in 512-byte LBAs: what the
                                      namespace's LBA size adds is added once the topology says it
    nvme_start   -> (at a clean stop) commands that ended without their completion traced,
                                      settled against the disks' in-flight counts (capture/settle.py)
    rdma_cq      -> rdma_cq          per kernel CQ: polls, completions, full-budget polls,
                                      wake-ups and their latency

The maps hold counts since the attach (every completion is counted in the kernel, sampled
or not); rows hold what changed since the previous flush, so the sums of a table's rows
are the exact totals.  The tables are read with the map objects' ``items()``, so tests give
plain Python objects and no bcc is imported here.
"""
from __future__ import annotations

import ctypes
import time
from collections import Counter

import pyarrow as pa

from kvtrace.capture import settle
from kvtrace.capture.events import map_items as _items
from kvtrace.capture.nvme import OPCLASSES, lba_bytes, want_topology
from kvtrace.dataset import schema

QFIELDS = ("setups", "completions", "bytes", "latency_ns", "errors", "retried", "unmatched", "unseen", "sq_samples",
           "sq_occ_sum")
CQFIELDS = ("polls", "completions", "full_polls", "wakeups", "wakeup_lat_us", "wakeup_lat_max_us", "interrupts",
            "reschedules")


def _int(v) -> int:
    return int(getattr(v, "value", v))


class KernelMaps:
    """Sidecar reading the nvme/rdma probes' maps; ``tables`` maps names to bcc tables (or
    anything with ``items()`` of (key, value) objects with the C field names)."""

    name = "nvme_queue"

    def __init__(self, tables: dict, ctx=None, cfg=None, settings: dict | None = None, root: str = "/"):
        self.t = tables
        self.root = root
        self.pending: dict[tuple, list] = {}   # (ctrl, qid, opclass) -> [commands, bytes] settled at the stop
        self.pending_tables: dict[str, pa.Table] = {}
        self.settings = dict(settings or {})   # recorded in the run row (sampling mode and rate)
        self.ctx = ctx
        self.cfg = cfg                 # the nvme_cfg map: its epoch is bumped after each read
        self.prev_q: dict[tuple, tuple] = {}
        self.prev_h: dict[tuple, int] = {}
        self.prev_cq: dict[int, tuple] = {}
        self.prev_fix: dict[tuple, int] = {}
        self.last_ns = time.monotonic_ns()
        self.c = Counter()
        self.epoch = 0

    def _ctrl(self, ctrl_id: int):
        ctrls = getattr(self.ctx, "nvme_ctrls", None) or {}
        return ctrls.get(ctrl_id)

    def _cpus(self, ctrl_id: int, qid: int) -> str:
        c = self._ctrl(ctrl_id)
        if c is None:
            return ""
        for ns in c.namespaces:
            for h in ns.hctx:
                if h.qid == qid:
                    return ",".join(map(str, h.cpus))
        return ""

    def drain(self) -> dict[str, pa.Table]:
        now = time.monotonic_ns()
        interval = now - self.last_ns
        self.last_ns = now
        out = {}
        if "nvme_qstats" in self.t:
            out.update(self._nvme(now, interval))
            self._bump_epoch()
        out.update(self.pending_tables)
        self.pending_tables = {}
        if "rdma_cq" in self.t:
            t = self._rdma(now, interval)
            if t is not None:
                out["rdma_cq"] = t
        return out

    def _bump_epoch(self) -> None:
        self.epoch += 1
        if self.cfg is None:
            return
        try:
            key = ctypes.c_int(0)
            leaf = self.cfg[key]
            leaf.epoch = self.epoch
            self.cfg[key] = leaf
        except Exception:
            self.c["cfg_errors"] += 1

    def _lba_extra(self) -> Counter:
        """Bytes 512-byte LBAs left out, per (controller, queue, op class), from nvme_lbafix.
        Read before nvme_qstats (the probe counts a command there first), so the bytes added
        never run ahead of the commands counted; blocks of a namespace whose LBA size is not
        known yet stay in the map's delta until it is."""
        out = Counter()
        if "nvme_lbafix" not in self.t:
            return out
        items = [((int(k.ctrl_id), int(k.nsid), int(k.qid), int(k.opclass)), _int(v)) for k, v in _items(self.t["nvme_lbafix"])]
        fresh = [(key, cur) for key, cur in items if cur > self.prev_fix.get(key, 0)]
        if self.ctx is not None and fresh:
            want_topology(self.ctx, namespaces={key[:2] for key, _ in fresh})
        for (ctrl, nsid, qid, opclass), cur in fresh:
            lba = lba_bytes(self.ctx, ctrl, nsid) if self.ctx is not None else None
            if not lba:
                continue
            blocks = cur - self.prev_fix.get((ctrl, nsid, qid, opclass), 0)
            self.prev_fix[(ctrl, nsid, qid, opclass)] = cur
            out[(ctrl, qid, opclass)] += blocks * (lba - 512)
            self.c["lba_fixed_blocks"] += blocks
        self.c["lba_unknown_blocks"] = sum(cur - self.prev_fix.get(key, 0) for key, cur in items)
        return out

    def _nvme(self, now: int, interval: int) -> dict[str, pa.Table]:
        rows = {c: [] for c in schema.TABLES["nvme_queue"].names}
        extra = self._lba_extra()
        for k, v in _items(self.t["nvme_qstats"]):
            key = (int(k.ctrl_id), int(k.qid), int(k.opclass))
            cur = tuple(int(getattr(v, f)) for f in QFIELDS)
            prev = self.prev_q.get(key, (0,) * len(QFIELDS))
            d = tuple(max(0, a - b) for a, b in zip(cur, prev))
            self.prev_q[key] = cur
            more = extra.pop(key, 0)
            if more:
                d = tuple(x + more if f == "bytes" else x for f, x in zip(QFIELDS, d))
            done = self.pending.pop(key, None)
            if done:   # ended untraced, found at the stop
                add = {"completions": done[0], "unseen": done[0], "bytes": done[1]}
                d = tuple(x + add.get(f, 0) for f, x in zip(QFIELDS, d))
            occ_max = int(getattr(v, "sq_occ_max", 0))
            fresh = int(getattr(v, "sq_epoch", self.epoch)) == self.epoch
            if not any(d):
                continue
            q = dict(zip(QFIELDS, d))
            c = self._ctrl(key[0])
            rows["ts_ns"].append(now)
            rows["interval_ns"].append(interval)
            rows["ctrl_id"].append(key[0])
            rows["ctrl"].append(f"nvme{key[0]}")
            rows["transport"].append(c.transport if c else "")
            rows["traddr"].append(c.target if c else "")
            rows["qid"].append(key[1])
            rows["opclass"].append(OPCLASSES[key[2]] if key[2] < len(OPCLASSES) else str(key[2]))
            for f in ("setups", "completions", "bytes", "errors", "retried", "unmatched", "unseen", "sq_samples"):
                rows[f].append(q[f])
            timed = q["completions"] - q["unseen"]
            rows["latency_sum_ns"].append(q["latency_ns"])
            rows["latency_avg_ns"].append(q["latency_ns"] / timed if timed > 0 else None)
            rows["sq_occupancy_avg"].append(q["sq_occ_sum"] / q["sq_samples"] if q["sq_samples"] else None)
            rows["sq_occupancy_max"].append(occ_max if q["sq_samples"] and fresh else None)
            rows["cpus"].append(self._cpus(key[0], key[1]))
            self.c["completions"] += q["completions"]
            self.c["unmatched"] += q["unmatched"]
            self.c["unseen"] += q["unseen"]
        hist = {c: [] for c in schema.TABLES["nvme_queue_hist"].names}
        for k, v in _items(self.t["nvme_hist"]):
            key = (int(k.ctrl_id), int(k.qid), int(k.opclass), int(k.slot))
            cur = _int(v)
            d = cur - self.prev_h.get(key, 0)
            self.prev_h[key] = cur
            if d <= 0:
                continue
            slot = key[3]
            hist["ts_ns"].append(now)
            hist["interval_ns"].append(interval)
            hist["ctrl_id"].append(key[0])
            hist["ctrl"].append(f"nvme{key[0]}")
            hist["qid"].append(key[1])
            hist["opclass"].append(OPCLASSES[key[2]] if key[2] < len(OPCLASSES) else str(key[2]))
            hist["slot"].append(slot)
            hist["lo_ns"].append(1 << (slot - 1) if slot else 0)
            hist["hi_ns"].append((1 << slot) - 1 if slot else 0)
            hist["count"].append(d)
        out = {}
        if rows["ts_ns"]:
            out["nvme_queue"] = _table("nvme_queue", rows)
        if hist["ts_ns"]:
            out["nvme_queue_hist"] = _table("nvme_queue_hist", hist)
        if "nvme_drops" in self.t:
            drops = {int(getattr(k, "value", k)): _int(v) for k, v in _items(self.t["nvme_drops"])}
            self.c["queue_map_full"] = drops.get(0, 0)
            self.c["hist_map_full"] = drops.get(1, 0)
            self.c["lbafix_map_full"] = drops.get(2, 0)
        self.c["flushes"] += 1
        return out

    def _rdma(self, now: int, interval: int) -> pa.Table | None:
        rows = {c: [] for c in schema.TABLES["rdma_cq"].names}
        for k, v in _items(self.t["rdma_cq"]):
            cq = _int(k)
            cur = tuple(int(getattr(v, f)) for f in CQFIELDS)
            prev = self.prev_cq.get(cq, (0,) * len(CQFIELDS))
            self.prev_cq[cq] = cur
            d = dict(zip(CQFIELDS, (max(0, a - b) for a, b in zip(cur, prev))))
            d["wakeup_lat_max_us"] = cur[CQFIELDS.index("wakeup_lat_max_us")]
            if not any(d[f] for f in ("polls", "wakeups", "interrupts", "reschedules")):
                continue
            rows["ts_ns"].append(now)
            rows["interval_ns"].append(interval)
            rows["cq_id"].append(cq)
            for f in ("polls", "completions", "full_polls", "wakeups", "interrupts", "reschedules"):
                rows[f].append(d[f])
            rows["wakeup_latency_sum_us"].append(d["wakeup_lat_us"])
            rows["wakeup_latency_max_us"].append(d["wakeup_lat_max_us"])
        return _table("rdma_cq", rows) if rows["ts_ns"] else None

    def stats(self) -> dict:
        return {**self.settings, **self.c}

    def lost(self) -> int:
        """Completions the kernel could not account for (a map was full)."""
        return self.c["queue_map_full"] + self.c["hist_map_full"]

    def close(self) -> None:
        """At a clean stop (before the last flush, the probes still attached): settle the NVMe
        commands left open; those that ended untraced go into the last flush's rows.  The maps
        belong to the BPF program, closed with the source."""
        if "nvme_start" not in self.t:
            return
        ctrls = getattr(self.ctx, "nvme_ctrls", None) or {}
        try:
            ended, still = settle.nvme_commands(self.t["nvme_start"], ctrls, self.root)
            self.pending, self.pending_tables = settle.nvme_rows(ended, time.monotonic_ns(), self.ctx)
        except Exception:
            self.c["settle_errors"] += 1
            return
        self.c["open_at_stop"] = still
        self.c["unseen_at_stop"] = len(ended)


def _table(name: str, cols: dict) -> pa.Table:
    sch = schema.TABLES[name]
    return pa.table({c: pa.array(cols[c], sch.field(c).type) for c in sch.names}, schema=sch)
