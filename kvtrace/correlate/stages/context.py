"""What every stage of a pass reads (Context), and the placement primitives: the earliest step
window holding a time (locate, StepIndex), the engine a process belongs to (engine_map), and
the KV transfer running on an event's thread at its time (thread_match)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrace.correlate.inputs import Cols, columns

HOW = ("none", "exact_id", "thread_time", "shared", "time_overlap")
NONE, EXACT, THREAD, SHARED, OVERLAP = range(5)
MAXBACK = 8  # how many earlier step windows are checked for overlap

# The recorded tables read through kvtrace.correlate.inputs.columns (NVMe/NIC tables are read
# from Context.tables by the overlap and nvme stages).
INPUTS = ("step", "chunk", "admit", "evict", "preempt", "kv_load", "kv_store", "arrive", "finish", "processes",
          "block_io", "file_io", "io_uring", "kv_alloc", "kv_done")


def locate(t: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each time: the earliest window (windows sorted by start) containing it, or -1, and the
    number of windows containing it."""
    idx = np.searchsorted(t0, t, "right") - 1
    best = np.full(len(t), -1, np.int64)
    count = np.zeros(len(t), np.int32)
    if len(t0) == 0 or len(t) == 0:
        return best, count
    for k in range(MAXBACK):
        j = idx - k
        ok = j >= 0
        if not ok.any():
            break
        jj = np.where(ok, j, 0)
        inside = ok & (t <= t1[jj])
        best = np.where(inside, j, best)
        count += inside
    return best, count


class StepIndex:
    """Step windows per engine process, sorted by start."""

    def __init__(self, steps: Cols):
        self.steps = steps
        self.engines: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.pos: dict[tuple[int, int], int] = {}
        pid, t0, t1 = steps["pid"], steps["t_start_ns"], steps["t_end_ns"]
        for e in np.unique(pid):
            sel = np.flatnonzero(pid == e)
            sel = sel[np.argsort(t0[sel], kind="stable")]
            self.engines[int(e)] = (sel, t0[sel], t1[sel])
        self.pos = {(int(p), int(s)): i for i, (p, s) in enumerate(zip(pid.tolist(), steps["step"].tolist()))}

    def locate(self, engine: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step row (index into steps) holding each time on its engine's timeline, and candidates."""
        pos = np.full(len(t), -1, np.int64)
        cand = np.zeros(len(t), np.int32)
        for e, (sel, t0, t1) in self.engines.items():
            m = engine == e
            if not m.any():
                continue
            b, c = locate(t[m], t0, t1)
            pos[m] = np.where(b >= 0, sel[np.maximum(b, 0)], -1)
            cand[m] = c
        return pos, cand

    def rows(self, pid: np.ndarray, step: np.ndarray) -> np.ndarray:
        """The step row each (engine pid, step number) names, -1 when that step's record is absent."""
        return np.array([self.pos.get((p, s), -1) for p, s in zip(pid.tolist(), step.tolist())], np.int64)

    def overlaps(self) -> np.ndarray:
        """Per step row: how many other steps of its engine overlap its window."""
        out = np.zeros(self.steps.n, np.int32)
        for sel, t0, t1 in self.engines.values():
            n = len(sel)
            later = np.maximum(np.searchsorted(t0, t1, "left") - np.arange(n) - 1, 0)
            diff = np.zeros(n + 1, np.int64)
            diff[np.arange(n) + 1] += 1
            np.add.at(diff, np.minimum(np.arange(n) + later + 1, n), -1)
            earlier = np.cumsum(diff)[:n]
            out[sel] = later + earlier
        return out


def engine_map(pids: np.ndarray, engines: list[int], processes: Cols) -> np.ndarray:
    """The engine (EngineCore pid) each process belongs to: with one engine, every traced process;
    with several, the engine among its ancestors (fork records), else 0 (none)."""
    if len(engines) == 1:
        return np.full(len(pids), engines[0], np.uint32)
    out = np.zeros(len(pids), np.uint32)
    if not engines:
        return out
    parent = {}
    forks = processes["event"] == "fork"
    for p, c in zip(processes["pid"][forks].tolist(), processes["child_pid"][forks].tolist()):
        parent.setdefault(c, p)
    eng = set(engines)
    memo = {}
    for p in np.unique(pids).tolist():
        q, seen = p, 0
        while q not in eng and q in parent and seen < 64:
            q, seen = parent[q], seen + 1
        memo[p] = q if q in eng else 0
    return np.array([memo[p] for p in pids.tolist()], np.uint32) if len(pids) else out


def thread_match(pid: np.ndarray, tid: np.ndarray, t: np.ndarray, eligible: np.ndarray, tr: Cols,
                 tr_named: np.ndarray) -> np.ndarray:
    """Per event: the KV transfer (row of tr) running on the event's thread (pid, tid) at its time
    t, transfers naming their request first; -1 if none or if the event is not ``eligible``."""
    out = np.full(len(t), -1, np.int64)
    if not tr.n:
        return out
    xkeys = (pid.astype(np.uint64) << np.uint64(32)) | tid.astype(np.uint64)
    for named in (True, False):
        sel_tr = np.flatnonzero(tr_named == named)
        if not len(sel_tr):
            continue
        keys = (tr["pid"][sel_tr].astype(np.uint64) << np.uint64(32)) | tr["tid"][sel_tr].astype(np.uint64)
        for key in np.unique(keys):
            group = sel_tr[keys == key]
            group = group[np.argsort(tr["t_start_ns"][group], kind="stable")]
            rows = np.flatnonzero((xkeys == key) & eligible & (out < 0))
            if not len(rows):
                continue
            b, _ = locate(t[rows], tr["t_start_ns"][group], tr["t_end_ns"][group])
            hit = b >= 0
            out[rows[hit]] = group[b[hit]]
    return out


@dataclass(frozen=True)
class Context:
    """The inputs of one pass, read by every stage and changed by none."""

    run: str
    tables: dict[str, pa.Table]     # the recorded tables as given (NVMe/NIC ones are read from here)
    cols: dict[str, Cols]           # the correlator's columns of each of INPUTS
    steps: Cols
    index: StepIndex
    engines: list[int]              # EngineCore pids with steps
    final: np.ndarray               # per step row: finalised by this pass
    horizon: np.uint64              # rows in no step that start before it are final
    io_span_bytes: int

    def final_of(self, step_rows: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Per row: final with its step (step_rows >= 0), else when it starts (t) before the horizon."""
        return np.where(step_rows >= 0, self.final[np.maximum(step_rows, 0)] if self.steps.n else False,
                        t < self.horizon)


def context(tables: dict[str, pa.Table], run: str = "", final_before: int | None = None,
            horizon: int | None = None, io_span_bytes: int = 1 << 20) -> Context:
    """The pass's Context (arguments as kvtrace.correlate.core.correlate)."""
    cols = {name: columns(tables.get(name), name) for name in INPUTS}
    steps = cols["step"]
    w = np.iinfo(np.uint64).max if final_before is None else np.uint64(final_before)
    h = w if horizon is None else np.uint64(min(int(horizon), int(w)))
    index = StepIndex(steps)
    return Context(run, tables, cols, steps, index, sorted(index.engines), steps["t_end_ns"] <= w, h, io_span_bytes)
