"""Per-step aggregates and the steps table.  Storage wait of a step: the union of its
connector-load intervals clipped to the execute window, plus the per-step records' measured
layer-load waits, at most the execute window; compute = execute window - storage wait;
bottleneck = the largest of storage wait, schedule time and compute."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import Context
from kvtrace.correlate.stages.evictions import Evictions, Preemptions
from kvtrace.correlate.stages.overlap import Overlaps
from kvtrace.correlate.stages.storage_io import KernelIO, step_io_bytes
from kvtrace.correlate.stages.transfers import Transfers

STEP_COUNTS = ("num_reqs", "total_tokens", "prefill_reqs", "prefill_tokens", "decode_reqs", "decode_tokens", "new_reqs",
               "resumed_reqs", "running", "waiting", "free_blocks")


def _union_len(iv: list[tuple[int, int]]) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(iv):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _critical_wait(ranks: dict[int, list], t0: int, t1: int) -> int:
    """A step's storage wait: its slowest rank's (the ranks run the step in lock step, so the step
    waits for the last of them), each rank's the union of its loads inside [t0, t1] plus the
    layer waits of its connector."""
    return max(_union_len([(max(a, t0), min(b, t1)) for a, b in iv]) + extra for iv, extra in ranks.values())


def bottleneck(sched_ns: int, storage_ns: int, compute_ns: int, resumed: bool = False) -> str:
    """The largest of scheduling, storage wait and compute; compute of a re-admitted request
    (recomputing what a preemption dropped) is ``recompute``."""
    if storage_ns > 0 and storage_ns >= compute_ns and storage_ns >= sched_ns:
        return "storage"
    if sched_ns > compute_ns and sched_ns > storage_ns:
        return "scheduler"
    return "recompute" if resumed else "compute"


@dataclass
class StepAgg:
    """Per step row (every step, final or not)."""

    sched_ns: np.ndarray
    exec_ns: np.ndarray
    storage_wait: np.ndarray
    compute: np.ndarray
    transfers: dict[str, np.ndarray]   # load_count, load_bytes, store_count, store_bytes
    io: dict[str, np.ndarray]          # storage I/O bytes by kind (storage_io.STEP_IO)


def step_aggregates(ctx: Context, transfers: Transfers, kio: dict[str, KernelIO]) -> StepAgg:
    steps, tr = ctx.steps, transfers.tr
    n = steps.n
    exec_start, exec_end = steps["t_sched_end_ns"].astype(np.int64), steps["t_end_ns"].astype(np.int64)
    sched_ns = np.maximum(steps["t_sched_end_ns"].astype(np.int64) - steps["t_start_ns"].astype(np.int64), 0)
    exec_ns = np.maximum(exec_end - exec_start, 0)
    # per step, per worker process (a tensor-parallel rank): its load intervals and layer waits
    loads: list[dict[int, list]] = [{} for _ in range(n)]
    agg = {k: np.zeros(n, np.int64) for k in ("load_count", "load_bytes", "store_count", "store_bytes")}
    for i in np.flatnonzero(transfers.step >= 0).tolist():
        s = int(transfers.step[i])
        d = tr["dir"][i]
        agg[f"{d}_count"][s] += 1
        agg[f"{d}_bytes"][s] += int(tr["nbytes"][i])
        if d == "load":
            t0 = int(tr["t_start_ns"][i])
            rank = loads[s].setdefault(int(tr["pid"][i]), [[], 0])
            if tr["source"][i].startswith("connector:"):
                rank[0].append((t0, int(tr["t_issue_end_ns"][i]) or int(tr["t_end_ns"][i])))
                rank[1] += int(tr["wait_ns"][i])
            else:
                rank[0].append((t0, int(tr["t_end_ns"][i])))
    storage_wait = np.zeros(n, np.int64)
    for s in range(n):
        if loads[s]:
            storage_wait[s] = min(_critical_wait(loads[s], int(exec_start[s]), int(exec_end[s])), int(exec_ns[s]))
    compute = np.maximum(exec_ns - storage_wait, 0)
    return StepAgg(sched_ns, exec_ns, storage_wait, compute, agg, step_io_bytes(n, kio))


def steps_table(ctx: Context, agg: StepAgg, chunks: Chunks, ev: Evictions, pr: Preemptions, ov: Overlaps) -> pa.Table:
    """The steps table: one row per step this pass finalises (docs/schema.md)."""
    steps, n = ctx.steps, ctx.steps.n
    per_step = {name: np.bincount(rows[rows >= 0], minlength=n) if n else np.zeros(0, np.int64)
                for name, rows in (("chunks", chunks.step), ("evicted_blocks", ev.step), ("preemptions", pr.step))}
    overlapping = ctx.index.overlaps()
    fs = np.flatnonzero(ctx.final)
    sched_ns, storage_wait, compute = agg.sched_ns, agg.storage_wait, agg.compute
    step_bneck = [bottleneck(int(sched_ns[s]), int(storage_wait[s]), int(compute[s])) for s in fs.tolist()]
    nic = ov.nic
    return pa.table({
        "engine_pid": pa.array(steps["pid"][fs], pa.uint32()),
        "step": pa.array(steps["step"][fs], pa.uint64()),
        "t_start_ns": pa.array(steps["t_start_ns"][fs], pa.uint64()),
        "t_sched_end_ns": pa.array(steps["t_sched_end_ns"][fs], pa.uint64()),
        "t_end_ns": pa.array(steps["t_end_ns"][fs], pa.uint64()),
        "sched_ns": pa.array(sched_ns[fs], pa.int64()),
        "exec_ns": pa.array(agg.exec_ns[fs], pa.int64()),
        **{k: pa.array(steps[k][fs], pa.uint32()) for k in STEP_COUNTS},
        **{k: pa.array(v[fs], pa.uint32()) for k, v in per_step.items()},
        "load_count": pa.array(agg.transfers["load_count"][fs], pa.uint32()),
        "load_bytes": pa.array(agg.transfers["load_bytes"][fs], pa.uint64()),
        "store_count": pa.array(agg.transfers["store_count"][fs], pa.uint32()),
        "store_bytes": pa.array(agg.transfers["store_bytes"][fs], pa.uint64()),
        "storage_wait_ns": pa.array(storage_wait[fs], pa.int64()),
        "compute_ns": pa.array(compute[fs], pa.int64()),
        **{k: pa.array(v[fs], pa.uint64()) for k, v in agg.io.items()},
        "overlapping_steps": pa.array(overlapping[fs], pa.uint32()),
        "nvme_commands": pa.array(ov.nvme_cmds[fs], pa.float64()),
        "nvme_bytes": pa.array(ov.nvme_bytes[fs], pa.float64()),
        "nic_deltas": pa.array([json.dumps(nic[s], sort_keys=True) if nic[s] else "" for s in fs.tolist()], pa.string()),
        "bottleneck": pa.array(step_bneck, pa.string()),
    })
