"""The recorded requests `kvtrace whatif` replays: per request its arrival, prompt (its chain of
block hashes), output length, when it finished, who it waited for (a closed-loop client) and its
place in the recorded order of first admissions; and the hits each first admission had."""
from __future__ import annotations

import bisect
import itertools

import pyarrow as pa

from kvtrace.analysis import load
from kvtrace.analysis.whatif.models import model_for
from kvtrace.analysis.whatif.workload import Req
from kvtrace.errors import DatasetError

CLOSED_LOOP_NS = 100_000_000


def col(t: pa.Table, name: str, default=None) -> list:
    return t[name].to_pylist() if name in t.column_names else [default] * t.num_rows


def chains(directory, pb: pa.Table) -> tuple[dict, int]:
    """(run, pid, request) -> its prompt_blocks parts; and the one recorded block size."""
    out: dict[tuple, dict] = {}
    bsz = set()
    for run, pid, rid, bs, plen, mo, first, hs in zip(col(pb, "run", ""), col(pb, "pid", 0), col(pb, "request"),
                                                      col(pb, "block_size"), col(pb, "prompt_len"), col(pb, "max_output", 0),
                                                      col(pb, "first"), col(pb, "hashes")):
        d = out.setdefault((run, pid, rid), {"bs": bs, "plen": plen, "max_out": mo or 0, "parts": {}})
        d["parts"][first] = hs or []
        bsz.add(bs)
    if len(bsz) != 1:
        raise DatasetError(f"{directory}: prompt_blocks records carry several block sizes {sorted(bsz)}; replay one run at a time")
    return out, bsz.pop()


def by_req(inp: load.Inputs, table: str, value: str, agg=min) -> dict:
    """(run, pid, request) -> agg of the table's non-null values of column `value`."""
    if not inp.has(table):
        return {}
    t = load.read_table(inp, table)
    out = {}
    for run, pid, rid, v in zip(col(t, "run", ""), col(t, "pid", 0), col(t, "request"), col(t, value)):
        if v is None:
            continue
        k = (run, pid, rid)
        out[k] = agg(out[k], v) if k in out else v
    return out


def step_times(steps: pa.Table, column: str) -> dict:
    """(run, pid, step) -> the step's time in ``column``."""
    return {(r, p, s): e for r, p, s, e in zip(col(steps, "run", ""), col(steps, "pid", 0), col(steps, "step"),
                                               col(steps, column))}


def _first_steps(adm: pa.Table) -> tuple[dict, dict]:
    """(run, pid, request) -> the step of its first admission; and -> the row of that admission
    (the hook sends a step's admissions in the engine's order)."""
    first_step, row = {}, {}
    for i, (run, pid, rid, att, s) in enumerate(zip(col(adm, "run", ""), col(adm, "pid", 0), col(adm, "request"),
                                                    col(adm, "attempt"), col(adm, "step"))):
        k = (run, pid, rid)
        if att == 0 and (k not in first_step or s < first_step[k]):
            first_step[k], row[k] = s, i
    return first_step, row


def recorded_requests(inp: load.Inputs, kind: str, prompts: dict, steps: pa.Table, notes: list) -> tuple[list, list]:
    """The requests in arrival order, and when each finished in the recording (None: unknown):
    the end of the step that finished it, the kind's CacheModel.finish_lag steps before its finish record."""
    arrivals = by_req(inp, "arrive", "t_ns")
    finish_step = by_req(inp, "finish", "step")
    out_tokens = by_req(inp, "finish", "output_tokens", max) if inp.has("finish") and "output_tokens" in inp.present.get("finish", ()) else {}
    st_end, st_start = step_times(steps, "t_end_ns"), step_times(steps, "t_start_ns")
    first_step, first_row = _first_steps(load.read_table(inp, "admit"))
    lag = model_for(kind).finish_lag
    reqs, finish_at, admitted = [], [], []
    missing_arrival = 0
    for k, d in prompts.items():
        chain = list(itertools.chain.from_iterable(d["parts"][f] for f in sorted(d["parts"])))
        arr = arrivals.get(k)
        if not arr:
            missing_arrival += 1
            arr = st_start.get((k[0], k[1], first_step.get(k, -1)), 0)
        out = out_tokens.get(k) or d["max_out"] or 1
        reqs.append(Req(k[2], int(arr), int(d["plen"]), int(out), chain, engine=int(k[1])))
        fs = finish_step.get(k)
        finish_at.append(st_end.get((k[0], k[1], fs - lag)) if fs is not None else None)
        reqs[-1].finished_at = finish_at[-1] or 0
        t_adm = st_start.get((k[0], k[1], first_step.get(k, -1)))
        admitted.append((t_adm is None, t_adm or 0, first_row.get(k, 0)))
    if missing_arrival:
        notes.append(f"{missing_arrival} requests have no arrive record: they arrive at their recorded first step")
    if not out_tokens:
        notes.append("output lengths are the requests' max_tokens (the finish records carry no output length)")
    # the recorded order of first admissions (by the admitting step's start, then the engine's
    # order within the step): the replay at the recorded setting admits in this order
    for rank, i in enumerate(sorted(range(len(reqs)), key=lambda i: (*admitted[i], reqs[i].arrival, reqs[i].rid))):
        reqs[i].rank = rank
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, reqs[i].rid))
    return [reqs[i] for i in order], [finish_at[i] for i in order]


def closed_loop(reqs: list, finish_at: list) -> int:
    """Mark each request sent within CLOSED_LOOP_NS of another's finish as triggered by it; how many."""
    fin_sorted = sorted((f, i) for i, f in enumerate(finish_at) if f)
    closed = 0
    keys = [f for f, _ in fin_sorted]
    for i, r in enumerate(reqs):
        j = bisect.bisect_right(keys, r.arrival) - 1
        if j >= 0 and r.arrival - keys[j] <= CLOSED_LOOP_NS and fin_sorted[j][1] != i:
            r.after, r.gap = fin_sorted[j][1], r.arrival - keys[j]
            closed += 1
    return closed


def first_hits(inp: load.Inputs, block_size: int) -> dict:
    """request -> the blocks (local and storage) it hit at its first admission, as recorded."""
    adm = load.read_table(inp, "admit")
    out = {}
    for rid, att, l, e in zip(col(adm, "request"), col(adm, "attempt"), col(adm, "cached_local", 0),
                              col(adm, "cached_external", 0)):
        if att == 0 and rid not in out:
            out[rid] = ((l or 0) + (e or 0)) // block_size
    return out
