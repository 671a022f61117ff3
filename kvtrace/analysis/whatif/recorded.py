"""What the recording itself did, beside `kvtrace whatif`'s predictions and for the replay at the
recorded setting: its figures (settings, hit rate, evictions, TTFT), the recorded steps' times
(the clock of that replay) and the step-duration model fitted to them."""
from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis import load
from kvtrace.analysis.whatif.models import model_for
from kvtrace.analysis.whatif.requests import by_req, col, step_times
from kvtrace.servers import registry


def figures(inp: load.Inputs, kind: str, steps: pa.Table, b0: int) -> dict:
    """The recorded settings and figures; the cache size from the kind's /metrics when they were
    scraped, else from the most free blocks the steps saw (cache.CacheModel.capacity)."""
    adm = load.read_table(inp, "admit")
    first = adm.filter(pc.equal(adm["attempt"], 0)) if adm.num_rows else adm
    seen, prompt, local, ext = set(), 0, 0, 0
    for rid, p, l, e in zip(col(first, "request"), col(first, "prompt_len"), col(first, "cached_local"),
                            col(first, "cached_external")):
        if rid in seen:
            continue
        seen.add(rid)
        prompt, local, ext = prompt + p, local + l, ext + e
    ev = load.read_table(inp, "evict").num_rows if inp.has("evict") else 0
    pre = load.read_table(inp, "preempt").num_rows if inp.has("preempt") else 0
    tokens = col(steps, "total_tokens", 0)
    free = col(steps, "free_blocks", 0)
    model, prefix = model_for(kind), registry.kind(kind).metrics_prefix
    samples = load.server_metrics(inp)
    cache_blocks, series = model.capacity(samples, prefix)
    return {"engine": kind, "chunk_size": max(tokens) if tokens else None, "block_size": b0,
            "cache_blocks": cache_blocks or ((max(free) + model.null_blocks) if free else None),
            "cache_blocks_from": series if cache_blocks else model.free_seen,
            "hit_rate": (local + ext) / prompt if prompt else None, "hit_local": local, "hit_external": ext,
            "prompt_tokens": prompt, "evictions": ev, "preemptions": pre,
            "new_token_ratio": model.new_token_ratio(samples, prefix)}


def ttft(inp: load.Inputs, steps: pa.Table) -> dict:
    """TTFT p50/p90 of the recording as the analysis counts it (arrival to the end of the step of
    the last prefill chunk), for the table beside the predictions."""
    ch = load.read_table(inp, "chunk")
    arr = by_req(inp, "arrive", "t_ns")
    st_end = step_times(steps, "t_end_ns")
    last = {}
    for run, pid, rid, att, step, is_last in zip(col(ch, "run", ""), col(ch, "pid", 0), col(ch, "request"),
                                                 col(ch, "attempt", 0), col(ch, "step"), col(ch, "last", 0)):
        if is_last and att == 0:
            k = (run, pid, rid)
            last[k] = min(last.get(k, step), step)
    t = sorted(st_end[(k[0], k[1], s)] - arr[k] for k, s in last.items() if k in arr and (k[0], k[1], s) in st_end)
    if not t:
        return {"p50_ns": None, "p90_ns": None}
    return {"p50_ns": t[(len(t) + 1) // 2 - 1], "p90_ns": t[max(-(-len(t) * 9 // 10) - 1, 0)]}


def clock(steps: pa.Table, reqs: list, finish_at: list) -> list | None:
    """What each recorded step took, in the order they ran: from its start to the next step's
    start (its execution and the scheduler's work before the next), or to its own end when no
    request was left in flight after it (the engine then waited for one).  None for a dataset
    of several engines or without step times."""
    if steps.num_rows == 0 or len(set(zip(col(steps, "run", ""), col(steps, "pid", 0)))) != 1:
        return None
    rows = sorted(zip(col(steps, "t_start_ns", 0), col(steps, "t_end_ns", 0)))
    if any(a is None or b is None or b < a for a, b in rows):
        return None
    arrived = sorted(r.arrival for r in reqs)
    done = sorted(f if f else float("inf") for f in finish_at)
    out = []
    for k, (t0, t1) in enumerate(rows):
        nxt = rows[k + 1][0] if k + 1 < len(rows) else None
        busy = bisect.bisect_right(arrived, t1) - bisect.bisect_right(done, t1)
        out.append(nxt - t0 if nxt is not None and nxt >= t1 and busy > 0 else t1 - t0)
    return out


def fit_steps(steps: pa.Table) -> tuple:
    """Step duration a + b*prefill_tokens + c*decode_reqs (ns), least squares over the recorded steps."""
    if steps.num_rows == 0:
        return (5e6, 0.0, 0.0)
    dur = np.array(col(steps, "t_end_ns", 0), dtype=float) - np.array(col(steps, "t_start_ns", 0), dtype=float)
    x = np.column_stack([np.ones(steps.num_rows), np.array(col(steps, "prefill_tokens", 0), float),
                         np.array(col(steps, "decode_reqs", 0), float)])
    ok = dur > 0
    if ok.sum() < 3:
        return (float(np.median(dur[ok])) if ok.any() else 5e6, 0.0, 0.0)
    coef, *_ = np.linalg.lstsq(x[ok], dur[ok], rcond=None)
    a, b, c = (max(float(v), 0.0) for v in coef)
    return (a, b, c)
