"""Attribution: which step, chunk, request and KV transfer each recorded event belongs to.

Pure functions over recorded tables (no root, no bcc), used live (kvtrace.correlate.live, on a
sliding window) and offline (kvtrace.correlate.derive, on a whole run).  The rules, in order
(docs/correlate.md):

* Steps.  A step is EngineCore's window [t_start_ns, t_end_ns] (schedule() start to
  update_from_output() end).  A time inside several windows (async scheduling overlaps steps)
  belongs to the earliest of them; ``candidates`` says how many windows contained it.
* Chunks, admissions, evictions, preemptions name their step and request: ``exact_id``.
* KV transfers (kv_load/kv_store) go to the step whose window holds their start.  One that names
  its request is ``exact_id`` to that request, and to the request's chunk in that step; an unnamed
  one (the per-step connector record) is ``shared`` by the step.
* Kernel storage I/O (block_io, storage file_io, io_uring data ops) issued on the thread of a KV
  transfer while that transfer runs is ``thread_time`` to it (a transfer naming its request wins
  over an unnamed one), and through it to its step, request and chunk.  Other storage I/O of the
  engine's processes goes to the step holding its start, ``shared``: nothing names the request,
  so chunks get a share in proportion to their scheduled tokens.  Outside every step: ``none``.
* NVMe commands (nvme_cmd: setup -> completion, weighted by their sampling weight) and NIC
  counter deltas (nic_counters: the polling interval before ts_ns) go to every step their
  interval overlaps, ``time_overlap``, with share = the overlapped fraction of the interval.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvtrace.correlate import ids
from kvtrace.correlate.inputs import OVERLAP_PREFIXES, Cols, columns, overlap_columns

HOW = ("none", "exact_id", "thread_time", "shared", "time_overlap")
NONE, EXACT, THREAD, SHARED, OVERLAP = range(5)
MAXBACK = 8  # how many earlier step windows are checked for overlap


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


@dataclass
class Result:
    """What one correlation pass decided, for the steps it finalised."""

    steps: pa.Table
    chunks: pa.Table
    attributions: pa.Table
    transfers: list[dict] = field(default_factory=list)      # finalised KV transfers, attributed
    io_groups: list[dict] = field(default_factory=list)      # kernel I/O per transfer, for spans
    evicts: list[dict] = field(default_factory=list)
    preempts: list[dict] = field(default_factory=list)
    admits: list[dict] = field(default_factory=list)
    arrives: list[dict] = field(default_factory=list)        # every arrive row seen (not only final)
    finishes: list[dict] = field(default_factory=list)
    done: dict[str, np.ndarray] = field(default_factory=dict)  # per input table: rows decided
    nvme_groups: list[dict] = field(default_factory=list)    # NVMe commands per step and queue, for chunk spans


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


def bottleneck(sched_ns: int, storage_ns: int, compute_ns: int, resumed: bool = False) -> str:
    """The largest of scheduling, storage wait and compute; compute of a re-admitted request
    (recomputing what a preemption dropped) is ``recompute``."""
    if storage_ns > 0 and storage_ns >= compute_ns and storage_ns >= sched_ns:
        return "storage"
    if sched_ns > compute_ns and sched_ns > storage_ns:
        return "scheduler"
    return "recompute" if resumed else "compute"


def correlate(tables: dict[str, pa.Table], run: str = "", final_before: int | None = None,
              horizon: int | None = None, io_span_bytes: int = 1 << 20) -> Result:
    """Attribute the rows of ``tables`` (one run of one host).

    final_before: only steps that ended before this time are finalised (live use); None = all.
    horizon: rows that start before it and fall in no step are final too (default final_before).
    io_span_bytes: block I/O at least this large gets its own span; smaller ones are aggregated
    per transfer, device and direction.
    """
    c = {name: columns(tables.get(name), name) for name in
         ("step", "chunk", "admit", "evict", "preempt", "kv_load", "kv_store", "arrive", "processes",
          "block_io", "file_io", "io_uring")}
    steps = c["step"]
    W = np.iinfo(np.uint64).max if final_before is None else np.uint64(final_before)
    H = W if horizon is None else np.uint64(min(int(horizon), int(W)))
    final = steps["t_end_ns"] <= W
    index = StepIndex(steps)
    engines = sorted(index.engines)
    overlaps = index.overlaps()

    # -- requests: trace ids from first-admission records ------------------------------------
    trace = {}
    for r, tp in zip(c["arrive"]["request"].tolist(), c["arrive"]["traceparent"].tolist()):
        if r not in trace or tp:
            trace[r] = ids.trace_of(run, r, tp)

    def trace_for(r: str):
        t = trace.get(r)
        if t is None:
            t = trace[r] = ids.trace_of(run, r, "")
        return t

    # -- chunks and admissions -----------------------------------------------------------------
    ch = c["chunk"]
    chunk_at: dict[tuple[int, int, str], int] = {}
    for i, key in enumerate(zip(ch["pid"].tolist(), ch["step"].tolist(), ch["request"].tolist())):
        chunk_at[key] = i
    ch_step = np.array([index.pos.get((p, s), -1) for p, s in zip(ch["pid"].tolist(), ch["step"].tolist())], np.int64)
    ad = c["admit"]
    admit_of = {k: i for i, k in enumerate(zip(ad["pid"].tolist(), ad["request"].tolist(), ad["attempt"].tolist()))}

    # -- KV transfers ---------------------------------------------------------------------------
    tr = {}
    for d, name in (("load", "kv_load"), ("store", "kv_store")):
        x = c[name]
        for k, v in x.items():
            tr.setdefault(k, []).append(v)
        tr.setdefault("dir", []).append(np.full(x.n, d, dtype=object))
    tr = Cols({k: np.concatenate(v) for k, v in tr.items()})
    tr.n = len(tr["dir"])
    tr_engine = engine_map(tr["pid"], engines, c["processes"])
    tr_step, tr_cand = index.locate(tr_engine, tr["t_start_ns"])
    tr_named = tr["request"] != ""
    tr_chunk = np.full(tr.n, -1, np.int64)
    for i in np.flatnonzero(tr_named & (tr_step >= 0)).tolist():
        s = int(tr_step[i])
        tr_chunk[i] = chunk_at.get((int(steps["pid"][s]), int(steps["step"][s]), tr["request"][i]), -1)
    tr_how = np.where(tr_named, EXACT, np.where(tr_step >= 0, SHARED, NONE))
    tr_final = np.where(tr_step >= 0, final[np.maximum(tr_step, 0)] if steps.n else False, tr["t_start_ns"] < H)

    # -- kernel storage I/O ------------------------------------------------------------------------
    kio = {}
    for name, t_start in (("block_io", "start_ns"), ("file_io", "start_ns"), ("io_uring", "submit_ns")):
        x = c[name]
        storage = np.ones(x.n, bool) if name == "block_io" else x["storage"]
        t = np.where(x[t_start] > 0, x[t_start], x["ts_ns"])
        transfer = np.full(x.n, -1, np.int64)
        # thread + time: inside a transfer of the same thread (named transfers first)
        for named in (True, False):
            sel_tr = np.flatnonzero(tr_named == named)
            if not len(sel_tr):
                continue
            keys = (tr["pid"][sel_tr].astype(np.uint64) << np.uint64(32)) | tr["tid"][sel_tr].astype(np.uint64)
            xkeys = (x["pid"].astype(np.uint64) << np.uint64(32)) | x["tid"].astype(np.uint64)
            for key in np.unique(keys):
                group = sel_tr[keys == key]
                group = group[np.argsort(tr["t_start_ns"][group], kind="stable")]
                rows = np.flatnonzero((xkeys == key) & storage & (transfer < 0))
                if not len(rows):
                    continue
                b, _ = locate(t[rows], tr["t_start_ns"][group], tr["t_end_ns"][group])
                hit = b >= 0
                transfer[rows[hit]] = group[b[hit]]
        engine = engine_map(x["pid"], engines, c["processes"])
        step, cand = index.locate(engine, t)
        via = transfer >= 0
        step = np.where(via, tr_step[np.maximum(transfer, 0)] if tr.n else -1, step)
        how = np.where(via, THREAD, np.where((step >= 0) & storage, SHARED, NONE))
        step = np.where(storage, step, -1)
        fin = np.where(step >= 0, final[np.maximum(step, 0)] if steps.n else False, t < H)
        kio[name] = dict(x=x, t=t, storage=storage, transfer=transfer, step=step, how=how, cand=cand, final=fin,
                         engine=engine)

    # -- evictions and preemptions name their step and request ---------------------------------------
    ev, pr = c["evict"], c["preempt"]
    ev_step = np.array([index.pos.get((p, s), -1) for p, s in zip(ev["pid"].tolist(), ev["step"].tolist())], np.int64)
    pr_step = np.array([index.pos.get((p, s), -1) for p, s in zip(pr["pid"].tolist(), pr["step"].tolist())], np.int64)
    ev_chunk = np.array([chunk_at.get((p, s, r), -1) for p, s, r in
                         zip(ev["pid"].tolist(), ev["step"].tolist(), ev["request"].tolist())], np.int64)
    pr_for_chunk = np.array([chunk_at.get((p, s, r), -1) for p, s, r in
                             zip(pr["pid"].tolist(), pr["step"].tolist(), pr["for_request"].tolist())], np.int64)

    def fin_of(stepcol, tcol):
        return np.where(stepcol >= 0, final[np.maximum(stepcol, 0)] if steps.n else False, tcol < H)

    ev_final, pr_final = fin_of(ev_step, ev["t_ns"]), fin_of(pr_step, pr["t_ns"])
    ch_final = fin_of(ch_step, np.zeros(ch.n, np.uint64))

    # -- NVMe / NIC rows overlapping steps --------------------------------------------------------------
    nvme_cmds = np.zeros(steps.n, np.float64)
    nvme_bytes = np.zeros(steps.n, np.float64)
    nic: list[dict] = [dict() for _ in range(steps.n)]
    overlap_attr = []
    overlap_done = {}
    nv_pairs: list[tuple[int, int]] = []   # (step row, nvme_cmd row) for every overlap
    for name in sorted(tables):
        if not name.startswith(OVERLAP_PREFIXES) or tables[name] is None or tables[name].num_rows == 0:
            continue
        x = overlap_columns(tables[name])
        if x is None:
            continue
        done = np.zeros(x.n, bool)
        latest_end = {e: (t1.max() if len(t1) else 0) for e, (_, _, t1) in index.engines.items()}
        for e, (sel, t0, t1) in index.engines.items():
            lo = np.searchsorted(t0, x["start"], "right") - 1 - MAXBACK
            hi = np.searchsorted(t0, x["end"], "right")
            for r in range(x.n):
                s0, s1 = int(x["start"][r]), int(x["end"][r])
                length = max(s1 - s0, 1)
                for j in range(max(int(lo[r]), 0), int(hi[r])):
                    a, b = max(s0, int(t0[j])), min(s1, int(t1[j]))
                    point = s0 == s1 and t0[j] <= s0 <= t1[j]
                    if b <= a and not point:
                        continue
                    row = int(sel[j])
                    share = 1.0 if point else (b - a) / length
                    if not final[row]:
                        continue
                    overlap_attr.append((name, s1, s0, row, share))
                    if name.startswith("nvme"):
                        nv_pairs.append((row, r))
                        weight = x["n:weight"][r] if "n:weight" in x and x["n:weight"][r] > 0 else 1.0
                        nvme_cmds[row] += share * weight
                        if "n:bytes" in x:
                            nvme_bytes[row] += share * weight * x["n:bytes"][r]
                    else:
                        key = next((str(x[k][r]) for k in ("s:counter", "s:name", "s:metric") if k in x), name)
                        if "s:device" in x or "s:port" in x:
                            key = f"{x.get('s:device', x.get('s:port'))[r]}/{key}"
                        val = next((x[k][r] for k in ("n:delta", "n:value") if k in x), None)
                        if val is not None:
                            nic[row][key] = nic[row].get(key, 0.0) + share * float(val)
            done |= x["end"] < min(int(latest_end[e]), int(H))
        if not index.engines:
            done |= x["end"] < H
        overlap_done[name] = done
    nv = _nvme_rows(tables.get("nvme_cmd"))
    nv_transfer = _thread_match(nv, tr, tr_named) if nv is not None else np.zeros(0, np.int64)
    if nv is not None and "nvme_cmd" in overlap_done:
        # a command issued by a transfer's thread stays until that transfer is decided
        pend = (nv_transfer >= 0) & ~tr_final[np.maximum(nv_transfer, 0)] if tr.n else np.zeros(nv.n, bool)
        overlap_done["nvme_cmd"] = overlap_done["nvme_cmd"] & ~pend

    # -- per-step aggregates (final steps) ------------------------------------------------------------
    n = steps.n
    exec_start, exec_end = steps["t_sched_end_ns"].astype(np.int64), steps["t_end_ns"].astype(np.int64)
    sched_ns = np.maximum(steps["t_sched_end_ns"].astype(np.int64) - steps["t_start_ns"].astype(np.int64), 0)
    exec_ns = np.maximum(exec_end - exec_start, 0)
    loads = [[] for _ in range(n)]
    extra_wait = np.zeros(n, np.int64)
    agg = {k: np.zeros(n, np.int64) for k in ("load_count", "load_bytes", "store_count", "store_bytes")}
    for i in np.flatnonzero(tr_step >= 0).tolist():
        s = int(tr_step[i])
        d = tr["dir"][i]
        agg[f"{d}_count"][s] += 1
        agg[f"{d}_bytes"][s] += int(tr["nbytes"][i])
        if d == "load":
            t0 = int(tr["t_start_ns"][i])
            if tr["source"][i].startswith("connector:"):
                loads[s].append((t0, int(tr["t_issue_end_ns"][i]) or int(tr["t_end_ns"][i])))
                extra_wait[s] += int(tr["wait_ns"][i])
            else:
                loads[s].append((t0, int(tr["t_end_ns"][i])))
    storage_wait = np.zeros(n, np.int64)
    for s in range(n):
        if loads[s] or extra_wait[s]:
            iv = [(max(a, int(exec_start[s])), min(b, int(exec_end[s]))) for a, b in loads[s]]
            storage_wait[s] = min(_union_len(iv) + int(extra_wait[s]), int(exec_ns[s]))
    compute = np.maximum(exec_ns - storage_wait, 0)

    io_sum = {k: np.zeros(n, np.int64) for k in ("file_read_bytes", "file_write_bytes", "block_read_bytes",
                                                  "block_write_bytes", "io_uring_bytes", "shared_file_bytes",
                                                  "shared_block_bytes")}
    for name, k in kio.items():
        x, st = k["x"], k["step"]
        m = st >= 0
        b = x["bytes"].astype(np.int64)
        if name == "block_io":
            np.add.at(io_sum["block_read_bytes"], st[m & x["is_read"]], b[m & x["is_read"]])
            np.add.at(io_sum["block_write_bytes"], st[m & x["is_write"]], b[m & x["is_write"]])
            sh = m & (k["how"] == SHARED)
            np.add.at(io_sum["shared_block_bytes"], st[sh], b[sh])
        else:
            if name == "file_io":
                np.add.at(io_sum["file_read_bytes"], st[m & x["is_read"]], b[m & x["is_read"]])
                np.add.at(io_sum["file_write_bytes"], st[m & ~x["is_read"]], b[m & ~x["is_read"]])
            else:
                np.add.at(io_sum["io_uring_bytes"], st[m], b[m])
            sh = m & (k["how"] == SHARED)
            np.add.at(io_sum["shared_file_bytes"], st[sh], b[sh])

    chunks_per_step = np.bincount(ch_step[ch_step >= 0], minlength=n) if n else np.zeros(0, np.int64)
    ev_per_step = np.bincount(ev_step[ev_step >= 0], minlength=n) if n else np.zeros(0, np.int64)
    pr_per_step = np.bincount(pr_step[pr_step >= 0], minlength=n) if n else np.zeros(0, np.int64)

    fs = np.flatnonzero(final)
    step_bneck = [bottleneck(int(sched_ns[s]), int(storage_wait[s]), int(compute[s])) for s in fs.tolist()]
    steps_tbl = pa.table({
        "engine_pid": pa.array(steps["pid"][fs], pa.uint32()),
        "step": pa.array(steps["step"][fs], pa.uint64()),
        "t_start_ns": pa.array(steps["t_start_ns"][fs], pa.uint64()),
        "t_sched_end_ns": pa.array(steps["t_sched_end_ns"][fs], pa.uint64()),
        "t_end_ns": pa.array(steps["t_end_ns"][fs], pa.uint64()),
        "sched_ns": pa.array(sched_ns[fs], pa.int64()),
        "exec_ns": pa.array(exec_ns[fs], pa.int64()),
        **{k: pa.array(steps[k][fs], pa.uint32()) for k in ("num_reqs", "total_tokens", "prefill_reqs", "prefill_tokens",
                                                            "decode_reqs", "decode_tokens", "new_reqs", "resumed_reqs",
                                                            "running", "waiting", "free_blocks")},
        "chunks": pa.array(chunks_per_step[fs], pa.uint32()),
        "evicted_blocks": pa.array(ev_per_step[fs], pa.uint32()),
        "preemptions": pa.array(pr_per_step[fs], pa.uint32()),
        "load_count": pa.array(agg["load_count"][fs], pa.uint32()),
        "load_bytes": pa.array(agg["load_bytes"][fs], pa.uint64()),
        "store_count": pa.array(agg["store_count"][fs], pa.uint32()),
        "store_bytes": pa.array(agg["store_bytes"][fs], pa.uint64()),
        "storage_wait_ns": pa.array(storage_wait[fs], pa.int64()),
        "compute_ns": pa.array(compute[fs], pa.int64()),
        **{k: pa.array(v[fs], pa.uint64()) for k, v in io_sum.items()},
        "overlapping_steps": pa.array(overlaps[fs], pa.uint32()),
        "nvme_commands": pa.array(nvme_cmds[fs], pa.float64()),
        "nvme_bytes": pa.array(nvme_bytes[fs], pa.float64()),
        "nic_deltas": pa.array([json.dumps(nic[s], sort_keys=True) if nic[s] else "" for s in fs.tolist()], pa.string()),
        "bottleneck": pa.array(step_bneck, pa.string()),
    })

    # -- per-chunk aggregates --------------------------------------------------------------------------
    nc = ch.n
    cagg = {k: np.zeros(nc, np.int64) for k in ("evicted_blocks", "preempted_others", "load_count", "load_blocks",
                                               "load_bytes", "load_ns", "store_count", "store_bytes",
                                               "file_read_bytes", "block_read_bytes")}
    if nc:
        m = ev_chunk >= 0
        np.add.at(cagg["evicted_blocks"], ev_chunk[m], 1)
        m = pr_for_chunk >= 0
        np.add.at(cagg["preempted_others"], pr_for_chunk[m], 1)
        for i in np.flatnonzero(tr_chunk >= 0).tolist():
            j = int(tr_chunk[i])
            d = tr["dir"][i]
            cagg[f"{d}_count"][j] += 1
            cagg[f"{d}_bytes"][j] += int(tr["nbytes"][i])
            if d == "load":
                cagg["load_blocks"][j] += int(tr["blocks"][i])
                cagg["load_ns"][j] += int(tr["t_end_ns"][i]) - int(tr["t_start_ns"][i])
        for name, col in (("file_io", "file_read_bytes"), ("block_io", "block_read_bytes")):
            k = kio[name]
            x = k["x"]
            m = (k["transfer"] >= 0) & x["is_read"]
            tc = tr_chunk[k["transfer"][m]] if m.any() else np.zeros(0, np.int64)
            ok = tc >= 0
            np.add.at(cagg[col], tc[ok], x["bytes"][m][ok].astype(np.int64))

    # NVMe per step: the latency of the commands overlapping it (each counted with its weight),
    # and the commands per (step, controller, queue, op class) for the chunks' spans
    nv_w = np.zeros(n, np.float64)
    nv_lat = np.zeros(n, np.float64)
    nv_max = np.zeros(n, np.int64)
    nv_by: dict[tuple, dict] = {}
    for row, r in nv_pairs:
        if nv["timed"][r]:   # a command that ended untraced has no latency
            w = float(nv["weight"][r])
            lat = int(nv["latency_ns"][r])
            nv_w[row] += w
            nv_lat[row] += w * lat
            nv_max[row] = max(nv_max[row], lat)
        g = nv_by.setdefault((row, nv["ctrl"][r], int(nv["qid"][r]), nv["opclass"][r]), _nvme_group(nv, r))
        _nvme_add(g, nv, r)
    nv_avg = np.divide(nv_lat, nv_w, out=np.zeros(n, np.float64), where=nv_w > 0)

    cs = np.flatnonzero(ch_final)
    chunks_of_step: dict[int, list] = {}
    for i in cs.tolist():
        if ch_step[i] >= 0:
            chunks_of_step.setdefault(int(ch_step[i]), []).append((ch["request"][i], int(ch["attempt"][i]), int(ch["step"][i])))
    nvme_groups = []
    for (row, ctrl, qid, opclass), g in sorted(nv_by.items(), key=lambda kv: kv[0]):
        if chunks_of_step.get(row):
            g["chunks"] = chunks_of_step[row]
            g["step"] = int(steps["step"][row])
            # the span shows the part inside the step's window (its chunks' spans)
            g["start_ns"] = max(g["start_ns"], int(steps["t_start_ns"][row]))
            g["end_ns"] = max(min(g["end_ns"], int(steps["t_end_ns"][row])), g["start_ns"])
            nvme_groups.append(g)
    rows = {k: [] for k in ("cached_tokens", "cached_local", "cached_external", "hit_blocks", "t_start_ns",
                            "t_end_ns", "sched_ns", "storage_wait_ns", "compute_ns", "step_tokens",
                            "shared_file_bytes", "shared_block_bytes", "bottleneck", "trace_id", "span_id",
                            "parent_span_id")}
    cnv = {k: [] for k in ("nvme_commands", "nvme_bytes", "nvme_latency_avg_ns", "nvme_latency_max_ns")}
    for i in cs.tolist():
        s = int(ch_step[i])
        cnv["nvme_commands"].append(float(nvme_cmds[s]) if s >= 0 else 0.0)
        cnv["nvme_bytes"].append(float(nvme_bytes[s]) if s >= 0 else 0.0)
        cnv["nvme_latency_avg_ns"].append(float(nv_avg[s]) if s >= 0 else 0.0)
        cnv["nvme_latency_max_ns"].append(int(nv_max[s]) if s >= 0 else 0)
        r = ch["request"][i]
        first = int(ch["chunk_index"][i]) == 0
        a = admit_of.get((int(ch["pid"][i]), r, int(ch["attempt"][i]))) if first else None
        loc = int(ad["cached_local"][a]) if a is not None else 0
        ext = int(ad["cached_external"][a]) if a is not None else 0
        rows["cached_local"].append(loc)
        rows["cached_external"].append(ext)
        rows["cached_tokens"].append(loc + ext)
        rows["hit_blocks"].append(int(ad["hit_blocks"][a]) if a is not None else 0)
        if s >= 0:
            tot = max(int(steps["total_tokens"][s]), 1)
            frac = int(ch["length"][i]) / tot
            rows["t_start_ns"].append(int(steps["t_start_ns"][s]))
            rows["t_end_ns"].append(int(steps["t_end_ns"][s]))
            rows["sched_ns"].append(int(sched_ns[s]))
            rows["storage_wait_ns"].append(int(storage_wait[s]))
            rows["compute_ns"].append(int(compute[s]))
            rows["step_tokens"].append(int(steps["total_tokens"][s]))
            rows["shared_file_bytes"].append(int(io_sum["shared_file_bytes"][s] * frac))
            rows["shared_block_bytes"].append(int(io_sum["shared_block_bytes"][s] * frac))
            rows["bottleneck"].append(bottleneck(int(sched_ns[s]), int(storage_wait[s]), int(compute[s]),
                                                 bool(ch["resumed"][i])))
        else:  # the step record was lost: the chunk has no window
            for k in ("t_start_ns", "t_end_ns", "sched_ns", "storage_wait_ns", "compute_ns", "step_tokens",
                      "shared_file_bytes", "shared_block_bytes"):
                rows[k].append(0)
            rows["bottleneck"].append("unknown")
        tid, _, _ = trace_for(r)
        rows["trace_id"].append(tid.hex())
        rows["span_id"].append(ids.chunk_span(tid, r, int(ch["attempt"][i]), int(ch["step"][i])).hex())
        rows["parent_span_id"].append(ids.request_span(tid, r).hex())
    u32 = pa.uint32()
    chunks_tbl = pa.table({
        "engine_pid": pa.array(ch["pid"][cs], u32),
        "step": pa.array(ch["step"][cs], pa.uint64()),
        "request": pa.array(ch["request"][cs].tolist(), pa.string()),
        "attempt": pa.array(ch["attempt"][cs], u32),
        "chunk_index": pa.array(ch["chunk_index"][cs], pa.int32()),
        "token_start": pa.array(ch["start"][cs], u32),
        "token_end": pa.array(ch["start"][cs].astype(np.int64) + ch["length"][cs], u32),
        "tokens": pa.array(ch["length"][cs], u32),
        "prompt_len": pa.array(ch["prompt_len"][cs], u32),
        "prefill_len": pa.array(ch["prefill_len"][cs], u32),
        "last": pa.array(ch["last"][cs].astype(bool), pa.bool_()),
        "resumed": pa.array(ch["resumed"][cs].astype(bool), pa.bool_()),
        "cached_tokens": pa.array(rows["cached_tokens"], u32),
        "cached_local": pa.array(rows["cached_local"], u32),
        "cached_external": pa.array(rows["cached_external"], u32),
        "hit_blocks": pa.array(rows["hit_blocks"], u32),
        "evicted_blocks": pa.array(cagg["evicted_blocks"][cs], u32),
        "preempted_others": pa.array(cagg["preempted_others"][cs], u32),
        "load_count": pa.array(cagg["load_count"][cs], u32),
        "load_blocks": pa.array(cagg["load_blocks"][cs], u32),
        "load_bytes": pa.array(cagg["load_bytes"][cs], pa.uint64()),
        "load_ns": pa.array(cagg["load_ns"][cs], pa.int64()),
        "store_count": pa.array(cagg["store_count"][cs], u32),
        "store_bytes": pa.array(cagg["store_bytes"][cs], pa.uint64()),
        "file_read_bytes": pa.array(cagg["file_read_bytes"][cs], pa.uint64()),
        "block_read_bytes": pa.array(cagg["block_read_bytes"][cs], pa.uint64()),
        "storage_wait_ns": pa.array(rows["storage_wait_ns"], pa.int64()),
        "compute_ns": pa.array(rows["compute_ns"], pa.int64()),
        "sched_ns": pa.array(rows["sched_ns"], pa.int64()),
        "step_tokens": pa.array(rows["step_tokens"], u32),
        "shared_file_bytes": pa.array(rows["shared_file_bytes"], pa.uint64()),
        "shared_block_bytes": pa.array(rows["shared_block_bytes"], pa.uint64()),
        "nvme_commands": pa.array(cnv["nvme_commands"], pa.float64()),
        "nvme_bytes": pa.array(cnv["nvme_bytes"], pa.float64()),
        "nvme_latency_avg_ns": pa.array(cnv["nvme_latency_avg_ns"], pa.float64()),
        "nvme_latency_max_ns": pa.array(cnv["nvme_latency_max_ns"], pa.int64()),
        "t_start_ns": pa.array(rows["t_start_ns"], pa.uint64()),
        "t_end_ns": pa.array(rows["t_end_ns"], pa.uint64()),
        "bottleneck": pa.array(rows["bottleneck"], pa.string()),
        "trace_id": pa.array(rows["trace_id"], pa.string()),
        "span_id": pa.array(rows["span_id"], pa.string()),
        "parent_span_id": pa.array(rows["parent_span_id"], pa.string()),
    })

    # -- attributions: one row per attributed (or unattributable) storage event -------------------------
    att = {k: [] for k in ("source", "ts_ns", "start_ns", "pid", "tid", "bytes", "engine_pid", "step", "request",
                           "attempt", "chunk_index", "transfer_start_ns", "how", "candidates", "share")}

    how_dict = pa.array(HOW, pa.string())

    def add(source, ts, start, pid, tid, nbytes, step_rows, req, attempt, cidx, tstart, how, cand, share):
        """req: a list of request ids, or (codes, distinct ids) for a dictionary column."""
        k = len(ts)
        if not k:
            return
        att["source"].append(pa.DictionaryArray.from_arrays(pa.array(np.zeros(k, np.int32)), pa.array([source])))
        att["ts_ns"].append(pa.array(ts, pa.uint64()))
        att["start_ns"].append(pa.array(start, pa.uint64()))
        att["pid"].append(pa.array(pid, u32))
        att["tid"].append(pa.array(tid, u32))
        att["bytes"].append(pa.array(nbytes, pa.uint64()))
        ok = step_rows >= 0
        sr = np.maximum(step_rows, 0)
        att["engine_pid"].append(pa.array(np.where(ok, steps["pid"][sr] if n else 0, 0), u32))
        att["step"].append(pa.array(np.where(ok, steps["step"][sr] if n else 0, 0), pa.uint64(), mask=~ok))
        if isinstance(req, tuple):
            att["request"].append(pa.DictionaryArray.from_arrays(pa.array(req[0], pa.int32()), pa.array(req[1], pa.string())))
        else:
            att["request"].append(pa.array(req, pa.string()).dictionary_encode())
        okc = cidx >= 0
        ci = np.maximum(cidx, 0)
        att["attempt"].append(pa.array(np.where(okc, ch["attempt"][ci] if nc else 0, 0), u32, mask=~okc))
        att["chunk_index"].append(pa.array(np.where(okc, ch["chunk_index"][ci] if nc else 0, 0), pa.int32(), mask=~okc))
        att["transfer_start_ns"].append(pa.array(tstart, pa.uint64(), mask=tstart == 0))
        att["how"].append(pa.DictionaryArray.from_arrays(pa.array(np.asarray(how, np.int32)), how_dict))
        att["candidates"].append(pa.array(cand, u32))
        att["share"].append(pa.array(share, pa.float64()))

    tr_requests = np.concatenate([tr["request"], np.array([""], dtype=object)]) if tr.n else np.array([""], dtype=object)
    for name, k in kio.items():
        x = k["x"]
        sel = np.flatnonzero(k["storage"] & k["final"])
        trn = k["transfer"][sel]
        okt = trn >= 0
        tsel = np.maximum(trn, 0)
        codes = np.where(okt, trn, tr.n).astype(np.int32)
        cidx = np.where(okt, tr_chunk[tsel], -1) if tr.n else np.full(len(sel), -1)
        tstart = np.where(okt, tr["t_start_ns"][tsel], 0).astype(np.uint64) if tr.n else np.zeros(len(sel), np.uint64)
        add(name, x["ts_ns"][sel], k["t"][sel], x["pid"][sel], x["tid"][sel], x["bytes"][sel], k["step"][sel],
            (codes, tr_requests), None, cidx, tstart, k["how"][sel], k["cand"][sel], np.ones(len(sel)))
    for d, name in (("load", "kv_load"), ("store", "kv_store")):
        sel = np.flatnonzero((tr["dir"] == d) & tr_final)
        add(name, tr["t_end_ns"][sel], tr["t_start_ns"][sel], tr["pid"][sel], tr["tid"][sel], tr["nbytes"][sel],
            tr_step[sel], tr["request"][sel].tolist(), None, tr_chunk[sel], np.zeros(len(sel), np.uint64),
            tr_how[sel], tr_cand[sel], np.ones(len(sel)))
    sel = np.flatnonzero(ev_final)
    add("evict", ev["t_ns"][sel], ev["t_ns"][sel], ev["pid"][sel], np.zeros(len(sel), np.uint32),
        np.zeros(len(sel), np.uint64), ev_step[sel], ev["request"][sel].tolist(), None, ev_chunk[sel],
        np.zeros(len(sel), np.uint64), np.where(ev["request"][sel] != "", EXACT, SHARED).astype(int),
        (ev_step[sel] >= 0).astype(np.int32), np.ones(len(sel)))
    sel = np.flatnonzero(pr_final)
    pr_chunk = np.array([chunk_at.get((p, s, r), -1) for p, s, r in
                         zip(pr["pid"][sel].tolist(), pr["step"][sel].tolist(), pr["request"][sel].tolist())], np.int64)
    add("preempt", pr["t_ns"][sel], pr["t_ns"][sel], pr["pid"][sel], np.zeros(len(sel), np.uint32),
        np.zeros(len(sel), np.uint64), pr_step[sel], pr["request"][sel].tolist(), None, pr_chunk,
        np.zeros(len(sel), np.uint64), np.full(len(sel), EXACT), (pr_step[sel] >= 0).astype(np.int32), np.ones(len(sel)))
    if nv is not None and tr.n:
        sel = np.flatnonzero((nv_transfer >= 0) & tr_final[np.maximum(nv_transfer, 0)])
        trn = nv_transfer[sel]
        add("nvme_cmd", nv["ts_ns"][sel], nv["setup_ns"][sel], nv["pid"][sel], nv["tid"][sel], nv["bytes"][sel],
            tr_step[trn], tr["request"][trn].tolist(), None, tr_chunk[trn], tr["t_start_ns"][trn].astype(np.uint64),
            np.full(len(sel), THREAD), np.ones(len(sel), np.int32), np.ones(len(sel)))
    if overlap_attr:
        o = list(zip(*overlap_attr))
        for name in sorted(set(o[0])):
            sel = [i for i, v in enumerate(o[0]) if v == name]
            srows = np.array([o[3][i] for i in sel], np.int64)
            add(name, np.array([o[1][i] for i in sel], np.uint64), np.array([o[2][i] for i in sel], np.uint64),
                np.zeros(len(sel), np.uint32), np.zeros(len(sel), np.uint32), np.zeros(len(sel), np.uint64), srows,
                [""] * len(sel), None, np.full(len(sel), -1), np.zeros(len(sel), np.uint64), np.full(len(sel), OVERLAP),
                np.ones(len(sel), np.int32), np.array([o[4][i] for i in sel], np.float64))
    attributions = pa.table({k: pa.chunked_array(v, ATTR_TYPES[k]) if v else pa.chunked_array([], ATTR_TYPES[k])
                             for k, v in att.items()})

    # -- what spans need: transfers (final) with their kernel I/O ----------------------------------------
    transfers, groups = [], []
    tsel = np.flatnonzero(tr_final)
    tindex = {}
    for i in tsel.tolist():
        s, j = int(tr_step[i]), int(tr_chunk[i])
        r = tr["request"][i]
        d = {"row": i, "dir": tr["dir"][i], "pid": int(tr["pid"][i]), "tid": int(tr["tid"][i]),
             "t_start_ns": int(tr["t_start_ns"][i]), "t_end_ns": int(tr["t_end_ns"][i]),
             "seq": int(tr["seq"][i]), "blocks": int(tr["blocks"][i]), "nbytes": int(tr["nbytes"][i]),
             "wait_ns": int(tr["wait_ns"][i]), "source": tr["source"][i], "request": r,
             "how": HOW[int(tr_how[i])],
             "engine_pid": int(steps["pid"][s]) if s >= 0 else 0, "step": int(steps["step"][s]) if s >= 0 else None,
             "attempt": int(ch["attempt"][j]) if j >= 0 else None, "chunk_index": int(ch["chunk_index"][j]) if j >= 0 else None,
             "chunk_step": int(ch["step"][j]) if j >= 0 else None}
        tindex[i] = len(transfers)
        transfers.append(d)
    for name, k in kio.items():
        x = k["x"]
        sel = np.flatnonzero((k["transfer"] >= 0) & k["final"])
        if not len(sel):
            continue
        trn = k["transfer"][sel]
        big = np.zeros(len(sel), bool)
        if name == "block_io":
            big = x["bytes"][sel] >= io_span_bytes
        # aggregate per (transfer, device/file kind, direction); big block I/O stays single
        if name == "block_io":
            dev = x["disk_code"][sel]
            names = x["disks"]
        else:
            dev = np.zeros(len(sel), np.int32)
            names = np.array([""], dtype=object)
        rd = x["is_read"][sel]
        for single in (False, True):
            m = big == single
            if not m.any():
                continue
            if single:
                for r in np.flatnonzero(m).tolist():
                    i = int(sel[r])
                    groups.append(_group(name, tindex.get(int(trn[r])), x, k["t"], np.array([i]), names[dev[r]],
                                         bool(rd[r]), single=True))
            else:
                keys = np.stack([trn[m], dev[m].astype(np.int64), rd[m].astype(np.int64)], axis=1)
                uk, inv = np.unique(keys, axis=0, return_inverse=True)
                inv = inv.reshape(-1)
                idx_m = sel[m]
                order = np.argsort(inv, kind="stable")
                bounds = np.searchsorted(inv[order], np.arange(len(uk) + 1))
                for g in range(len(uk)):
                    rows_g = idx_m[order[bounds[g]:bounds[g + 1]]]
                    groups.append(_group(name, tindex.get(int(uk[g][0])), x, k["t"], rows_g, names[int(uk[g][1])],
                                         bool(uk[g][2]), single=False))
    if nv is not None and tr.n:
        by_tq: dict[tuple, dict] = {}
        for r in np.flatnonzero(nv_transfer >= 0).tolist():
            t = tindex.get(int(nv_transfer[r]))
            if t is None:
                continue
            g = by_tq.setdefault((t, nv["ctrl"][r], int(nv["qid"][r]), nv["opclass"][r]), _nvme_group(nv, r, t))
            _nvme_add(g, nv, r)
        for k in sorted(by_tq):
            g, t = by_tq[k], transfers[k[0]]
            g["start_ns"] = max(g["start_ns"], t["t_start_ns"])   # the part inside the transfer
            g["end_ns"] = max(min(g["end_ns"], t["t_end_ns"]), g["start_ns"])
            groups.append(g)
    groups = [g for g in groups if g["transfer"] is not None]

    evicts = [{"engine_pid": int(ev["pid"][i]), "step": int(ev["step"][i]), "t_ns": int(ev["t_ns"][i]),
               "block_hash": int(ev["block_hash"][i]), "group": int(ev["group"][i]), "block_id": int(ev["block_id"][i]),
               "medium": ev["medium"][i], "request": ev["request"][i],
               "chunk": (int(ch["attempt"][ev_chunk[i]]), int(ch["step"][ev_chunk[i]])) if ev_chunk[i] >= 0 else None}
              for i in np.flatnonzero(ev_final).tolist()]
    preempts = [{"engine_pid": int(pr["pid"][i]), "step": int(pr["step"][i]), "t_ns": int(pr["t_ns"][i]),
                 "request": pr["request"][i], "computed_before": int(pr["computed_before"][i]),
                 "num_tokens": int(pr["num_tokens"][i]), "num_preemptions": int(pr["num_preemptions"][i]),
                 "for_request": pr["for_request"][i],
                 "for_chunk": (int(ch["attempt"][pr_for_chunk[i]]), int(ch["step"][pr_for_chunk[i]]))
                 if pr_for_chunk[i] >= 0 else None}
                for i in np.flatnonzero(pr_final).tolist()]

    admit_step = np.array([index.pos.get((p, s), -1) for p, s in zip(ad["pid"].tolist(), ad["step"].tolist())], np.int64)
    ad_final = fin_of(admit_step, np.zeros(ad.n, np.uint64))
    admits = [{k: (ad[k][i] if k == "request" else int(ad[k][i])) for k in ad} for i in np.flatnonzero(ad_final).tolist()]
    ar = c["arrive"]
    arrives = [{"engine_pid": int(ar["pid"][i]), "request": ar["request"][i], "t_ns": int(ar["t_ns"][i]),
                "traceparent": ar["traceparent"][i], "tracestate": ar["tracestate"][i]} for i in range(ar.n)]
    fi = columns(tables.get("finish"), "finish")
    fi_step = np.array([index.pos.get((p, s), -1) for p, s in zip(fi["pid"].tolist(), fi["step"].tolist())], np.int64)
    fi_final = fin_of(fi_step, fi["t_ns"])
    finishes = [{"engine_pid": int(fi["pid"][i]), "request": fi["request"][i], "t_ns": int(fi["t_ns"][i])}
                for i in np.flatnonzero(fi_final).tolist()]

    done = {"step": final, "admit": ad_final, "finish": fi_final, "chunk": ch_final, "evict": ev_final, "preempt": pr_final,
            "kv_load": tr_final[: c["kv_load"].n], "kv_store": tr_final[c["kv_load"].n:],
            **{name: k["final"] | ~k["storage"] & (k["t"] < H) for name, k in kio.items()}, **overlap_done}
    return Result(steps_tbl, chunks_tbl, attributions, transfers, groups, evicts, preempts, admits, arrives,
                  finishes, done, nvme_groups)


NVME_COLS = {"ts_ns": "u8", "setup_ns": "u8", "latency_ns": "i8", "pid": "u4", "tid": "u4", "qid": "u4", "bytes": "u8",
             "status": "u4", "weight": "u4", "sq_occupancy": "i8"}
NVME_TEXT = ("ctrl", "transport", "traddr", "opclass")


def _nvme_rows(table: pa.Table | None) -> Cols | None:
    """nvme_cmd's columns the spans and thread matching need (weight 0 or missing = 1)."""
    if table is None or table.num_rows == 0:
        return None
    import pyarrow.compute as pc

    out = Cols()
    for c, dt in NVME_COLS.items():
        out[c] = (table[c].fill_null(0).to_numpy(zero_copy_only=False).astype(dt) if c in table.column_names
                  else np.zeros(table.num_rows, dt))
    out["has_occ"] = (pc.is_valid(table["sq_occupancy"]).to_numpy(zero_copy_only=False)
                      if "sq_occupancy" in table.column_names else np.zeros(table.num_rows, bool))
    for c in NVME_TEXT:
        out[c] = (np.asarray(table[c].cast(pa.string()).fill_null("").to_pylist(), dtype=object) if c in table.column_names
                  else np.full(table.num_rows, "", dtype=object))
    out["weight"] = np.maximum(out["weight"], 1)
    out["setup_ns"] = np.where(out["setup_ns"] > 0, out["setup_ns"], out["ts_ns"])
    # a command that ended without its completion traced (latency null): its end is unknown, so
    # it is placed at its setup and left out of latencies
    out["timed"] = (pc.is_valid(table["latency_ns"]).to_numpy(zero_copy_only=False)
                    if "latency_ns" in table.column_names else np.ones(table.num_rows, bool))
    out["ts_ns"] = np.where(out["timed"], out["ts_ns"], out["setup_ns"])
    out.n = table.num_rows
    return out


def _thread_match(nv: Cols, tr: Cols, tr_named: np.ndarray) -> np.ndarray:
    """Per NVMe command: the KV transfer whose thread issued it (the block layer's issuer) while
    that transfer ran, named transfers first; -1 if none."""
    out = np.full(nv.n, -1, np.int64)
    if not tr.n:
        return out
    xkeys = (nv["pid"].astype(np.uint64) << np.uint64(32)) | nv["tid"].astype(np.uint64)
    for named in (True, False):
        sel_tr = np.flatnonzero(tr_named == named)
        if not len(sel_tr):
            continue
        keys = (tr["pid"][sel_tr].astype(np.uint64) << np.uint64(32)) | tr["tid"][sel_tr].astype(np.uint64)
        for key in np.unique(keys):
            group = sel_tr[keys == key]
            group = group[np.argsort(tr["t_start_ns"][group], kind="stable")]
            rows = np.flatnonzero((xkeys == key) & (out < 0) & (nv["tid"] != 0))
            if not len(rows):
                continue
            b, _ = locate(nv["setup_ns"][rows], tr["t_start_ns"][group], tr["t_end_ns"][group])
            hit = b >= 0
            out[rows[hit]] = group[b[hit]]
    return out


def _nvme_group(nv: Cols, r: int, transfer: int | None = None) -> dict:
    return {"kind": "nvme_cmd", "transfer": transfer, "single": False, "ctrl": nv["ctrl"][r], "qid": int(nv["qid"][r]),
            "opclass": nv["opclass"][r], "transport": nv["transport"][r], "traddr": nv["traddr"][r],
            "device": f"{nv['ctrl'][r]} q{int(nv['qid'][r])} {nv['opclass'][r]}", "read": nv["opclass"][r] == "read",
            "start_ns": int(nv["setup_ns"][r]), "end_ns": int(nv["ts_ns"][r]), "first_start_ns": int(nv["setup_ns"][r]),
            "count": 0, "samples": 0, "bytes": 0, "latency_ns_sum": 0, "latency_ns_max": 0, "errors": 0,
            "sq_occ_sum": 0, "sq_occ_n": 0}


def _nvme_add(g: dict, nv: Cols, r: int) -> None:
    w = int(nv["weight"][r])
    lat = int(nv["latency_ns"][r])
    g["count"] += w
    g["samples"] += 1
    g["bytes"] += w * int(nv["bytes"][r])
    if nv["timed"][r]:
        g["latency_ns_sum"] += w * lat
        g["latency_ns_max"] = max(g["latency_ns_max"], lat)
    else:
        g["untraced"] = g.get("untraced", 0) + w
    g["errors"] += w * (int(nv["status"][r]) != 0)
    g["start_ns"] = min(g["start_ns"], int(nv["setup_ns"][r]))
    g["first_start_ns"] = g["start_ns"]
    g["end_ns"] = max(g["end_ns"], int(nv["ts_ns"][r]))
    if nv["has_occ"][r]:
        g["sq_occ_sum"] += int(nv["sq_occupancy"][r])
        g["sq_occ_n"] += 1


def _group(name: str, transfer: int | None, x: Cols, t: np.ndarray, rows: np.ndarray, device: str, read: bool,
           single: bool) -> dict:
    b = x["bytes"][rows].astype(np.int64)
    lat = x["latency_ns"][rows].astype(np.int64)
    g = {"kind": name, "transfer": transfer, "single": single, "device": device, "read": read,
         "start_ns": int(t[rows].min()), "end_ns": int(x["ts_ns"][rows].max()), "count": len(rows),
         "bytes": int(b.sum()), "latency_ns_sum": int(lat.sum()), "latency_ns_max": int(lat.max()) if len(rows) else 0,
         "first_start_ns": int(t[rows].min())}
    if name == "block_io":
        g["queue_ns_sum"] = int(x["queue_ns"][rows].astype(np.int64).sum())
        g["device_ns_sum"] = int(x["device_ns"][rows].astype(np.int64).sum())
        g["errors"] = int((x["error"][rows] != 0).sum())
        if single:
            g["sector"] = int(x["sector"][rows[0]])
    elif name == "file_io":
        g["files"] = int(len(np.unique(x["path_code"][rows])))
        g["errors"] = int((x["ret"][rows] < 0).sum())
    else:
        g["errors"] = int((x["res"][rows] < 0).sum())
    return g


_D = pa.dictionary(pa.int32(), pa.string())
ATTR_TYPES = {"source": _D, "ts_ns": pa.uint64(), "start_ns": pa.uint64(), "pid": pa.uint32(),
              "tid": pa.uint32(), "bytes": pa.uint64(), "engine_pid": pa.uint32(), "step": pa.uint64(),
              "request": _D, "attempt": pa.uint32(), "chunk_index": pa.int32(),
              "transfer_start_ns": pa.uint64(), "how": _D, "candidates": pa.uint32(), "share": pa.float64()}
