"""How long `kvtrace whatif` makes a step wait for KV loads from a storage tier of a given speed
(docs/analysis.md, "The storage tier's speed").

A block loaded from the tier costs ``fixed + io`` nanoseconds, paid in the step that admits the
request (vLLM waits for synchronous loads before the forward):

* ``io``: the read itself.  At the recorded speed, the read system calls the kernel saw on the
  loading thread during the recorded loads (kvtrace's file_io rows inside each kv_load), per
  block loaded.  At ``@READ_GBPS[/LATENCY_US]``: LATENCY_US + block bytes / READ_GBPS.
* ``fixed``: the connector's own work per block outside those reads (opening the block's file,
  copying it into the KV cache): the recorded load time minus the recorded reads, per block.

The step's other time is the fitted a + b·prefill tokens + c·decode requests
(recorded.fit_steps), fitted on the recorded steps during which nothing was loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrace.analysis import load

READS = ("read", "pread64", "readv", "preadv", "preadv2")


@dataclass
class StorageModel:
    block_bytes: int = 0        # bytes of one loaded (or stored) block
    fixed_ns: float = 0.0       # per block: the connector's work besides the reads
    io_ns: float = 0.0          # per block: the reads, at the recorded speed
    loads: int = 0              # recorded per-request loads the model was fitted on
    blocks: int = 0
    read_bytes: int = 0         # bytes the kernel read for them
    note: str = ""

    def per_block_ns(self, gbps: float | None = None, latency_us: float | None = None) -> float:
        if gbps is None:
            io = self.io_ns if latency_us is None else latency_us * 1e3
        else:
            io = (latency_us or 0.0) * 1e3 + self.block_bytes / gbps
        return self.fixed_ns + io

    @property
    def recorded_gbps(self) -> float | None:
        """The recorded read speed (GB/s): bytes the kernel read over the time in those reads."""
        return (self.read_bytes / (self.io_ns * self.blocks)) if self.io_ns and self.blocks else None

    def to_json(self) -> dict:
        return {"block_bytes": self.block_bytes, "fixed_ns_per_block": round(self.fixed_ns),
                "read_ns_per_block": round(self.io_ns), "recorded_read_gbps": self.recorded_gbps,
                "fitted_on_loads": self.loads, "blocks": self.blocks, "note": self.note}


def _cols(t: pa.Table, *names) -> list[np.ndarray]:
    return [np.asarray(t[n].to_numpy(zero_copy_only=False)) if n in t.column_names else np.zeros(t.num_rows) for n in names]


def load_intervals(inp: load.Inputs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The recorded per-request KV loads: (pid, start, end, blocks, bytes), blocks > 0."""
    if not inp.has("kv_load"):
        return tuple(np.zeros(0) for _ in range(5))
    t = load.read_table(inp, "kv_load")
    pid, t0, t1, blocks, nbytes = _cols(t, "pid", "t_start_ns", "t_end_ns", "blocks", "nbytes")
    req = np.array([r or "" for r in t["request"].to_pylist()], dtype=object) if "request" in t.column_names else np.array([])
    ok = (blocks > 0) & (req != "") if len(req) else blocks > 0
    return pid[ok].astype(np.int64), t0[ok].astype(np.int64), t1[ok].astype(np.int64), blocks[ok].astype(np.int64), nbytes[ok].astype(np.int64)


def fit(inp: load.Inputs) -> StorageModel:
    """The storage model of the recorded run (empty when it loaded nothing)."""
    pid, t0, t1, blocks, nbytes = load_intervals(inp)
    m = StorageModel()
    if len(blocks):
        m.loads, m.blocks = len(blocks), int(blocks.sum())
        m.block_bytes = int(round(nbytes.sum() / m.blocks))
        total = float((t1 - t0).sum())
        read_ns, read_bytes = _reads_inside(inp, pid, t0, t1)
        if read_ns is None:
            m.io_ns, m.note = total / m.blocks, "no file reads recorded: each load's whole time counts as reading"
        else:
            m.io_ns, m.read_bytes = read_ns / m.blocks, read_bytes
            m.fixed_ns = max(total - read_ns, 0.0) / m.blocks
    elif inp.has("kv_store"):
        t = load.read_table(inp, "kv_store")
        b, n = _cols(t, "blocks", "nbytes")
        if b.sum() > 0:
            m.block_bytes = int(round(n.sum() / b.sum()))
        m.note = "no KV loads recorded: block size from the stores, no per-block overhead measured"
    else:
        m.note = "no KV connector transfers recorded: a tier's speed cannot be sized"
    return m


def _reads_inside(inp: load.Inputs, pid, t0, t1) -> tuple[float | None, int]:
    """Time and bytes of the read system calls of each load's process inside the load."""
    if not inp.has("file_io"):
        return None, 0
    f = load.read_table(inp, "file_io")
    fp, fs, fe, fb, fw = _cols(f, "pid", "start_ns", "ts_ns", "bytes", "weight")
    sc = np.array(f["syscall"].to_pylist(), dtype=object)
    reads = np.isin(sc, READS)
    fw = np.where(fw > 0, fw, 1)
    total_ns, total_b = 0.0, 0
    for p in np.unique(pid):
        mine = reads & (fp == p)
        s, e, b, w = fs[mine].astype(np.int64), fe[mine].astype(np.int64), fb[mine], fw[mine]
        order = np.argsort(s)
        s, e, b, w = s[order], e[order], b[order], w[order]
        for a, z in zip(t0[pid == p], t1[pid == p]):
            lo, hi = np.searchsorted(s, a, "left"), np.searchsorted(s, z, "right")
            inside = e[lo:hi] <= z
            total_ns += float(((e[lo:hi] - s[lo:hi]) * w[lo:hi])[inside].sum())
            total_b += int((b[lo:hi] * w[lo:hi])[inside].sum())
    return total_ns, total_b


def quiet_steps(steps: pa.Table, inp: load.Inputs) -> np.ndarray:
    """Per recorded step: True when no KV load ran in its window (the steps the step model fits)."""
    n = steps.num_rows
    pid, t0, t1, _, _ = load_intervals(inp)
    if not len(t0) or not n:
        return np.ones(n, bool)
    s0, s1 = _cols(steps, "t_start_ns", "t_end_ns")
    s0, s1 = s0.astype(np.int64), s1.astype(np.int64)
    order = np.argsort(t0)
    a, z = t0[order], np.maximum.accumulate(t1[order])
    j = np.searchsorted(a, s1, "right") - 1       # the last load starting before the step ends
    return ~((j >= 0) & (z[np.maximum(j, 0)] > s0))
