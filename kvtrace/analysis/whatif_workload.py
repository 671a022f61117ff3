"""The workload `kvtrace whatif` replays, read from a recorded dataset: per request its arrival,
prompt as a chain of block hashes, output length, who it waited for (a closed-loop client) and
its place in the recorded order of first admissions; the recorded figures to compare with; the
step-duration model fitted to the recorded steps, and the recorded steps' own times (the clock
of the replay at the recorded setting).  (The model itself: kvtrace/analysis/whatif.py.)"""
from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis import load
from kvtrace.analysis.whatif_storage import StorageModel, fit, quiet_steps
from kvtrace.errors import DatasetError

CLOSED_LOOP_NS = 100_000_000


@dataclass
class Req:
    rid: str
    arrival: int
    prompt_len: int
    output: int
    chain: list                     # hashes of recorded-size blocks
    after: int = -1                 # index of the request whose finish triggers it (closed loop)
    gap: int = 0
    rank: int = -1                  # its place in the recorded order of first admissions (-1: unknown)
    # replay state
    keys: list = field(default_factory=list)
    num_tokens: int = 0
    computed: int = 0
    generated: int = 0
    blocks: list = field(default_factory=list)
    attempt: int = 0
    hashed: int = 0                 # leading blocks already hashed
    admitted: bool = False
    distinct: bool = True           # no key twice in the prompt (so no block twice in blocks)
    done_ns: int = 0
    first_token_ns: int = 0
    arrived_ns: int = 0


@dataclass
class Workload:
    reqs: list
    block_size: int
    recorded: dict
    model: tuple
    notes: list
    storage: StorageModel = field(default_factory=StorageModel)
    engine: str = "vllm"            # "sglang": replayed through its radix cache (kvtrace.analysis.whatif_radix)
    clock: list | None = None       # the recorded steps' times, in order (recorded_clock); None: not known
    hits: dict = field(default_factory=dict)   # request -> blocks it hit at its first admission, as recorded
    passes_before: int | None = None           # SGLang's pass count at the attach (whatif_radix.passes_before)

    def distinct(self) -> dict:
        """id(chain) -> whether the chain has no hash twice (computed once for every replay)."""
        if getattr(self, "_distinct", None) is None:
            self._distinct = {id(r.chain): len(set(r.chain)) == len(r.chain) for r in self.reqs}
        return self._distinct


def _col(t: pa.Table, name: str, default=None):
    return t[name].to_pylist() if name in t.column_names else [default] * t.num_rows


def _chains(directory, pb: pa.Table) -> tuple[dict, int]:
    """(run, pid, request) -> its prompt_blocks parts; and the one recorded block size."""
    chains: dict[tuple, dict] = {}
    bsz = set()
    for run, pid, rid, bs, plen, mo, first, hs in zip(_col(pb, "run", ""), _col(pb, "pid", 0), _col(pb, "request"),
                                                      _col(pb, "block_size"), _col(pb, "prompt_len"), _col(pb, "max_output", 0),
                                                      _col(pb, "first"), _col(pb, "hashes")):
        d = chains.setdefault((run, pid, rid), {"bs": bs, "plen": plen, "max_out": mo or 0, "parts": {}})
        d["parts"][first] = hs or []
        bsz.add(bs)
    if len(bsz) != 1:
        raise DatasetError(f"{directory}: prompt_blocks records carry several block sizes {sorted(bsz)}; replay one run at a time")
    return chains, bsz.pop()


def _by_req(inp: load.Inputs, table: str, value: str, agg=min) -> dict:
    """(run, pid, request) -> agg of the table's non-null values of column `value`."""
    if not inp.has(table):
        return {}
    t = load.read_table(inp, table)
    out = {}
    for run, pid, rid, v in zip(_col(t, "run", ""), _col(t, "pid", 0), _col(t, "request"), _col(t, value)):
        if v is None:
            continue
        k = (run, pid, rid)
        out[k] = agg(out[k], v) if k in out else v
    return out


def _first_steps(adm: pa.Table) -> tuple[dict, dict]:
    """(run, pid, request) -> the step of its first admission; and -> the row of that admission
    (the hook sends a step's admissions in the engine's order)."""
    first_step, row = {}, {}
    for i, (run, pid, rid, att, s) in enumerate(zip(_col(adm, "run", ""), _col(adm, "pid", 0), _col(adm, "request"),
                                                    _col(adm, "attempt"), _col(adm, "step"))):
        k = (run, pid, rid)
        if att == 0 and (k not in first_step or s < first_step[k]):
            first_step[k], row[k] = s, i
    return first_step, row


def _requests(inp: load.Inputs, chains: dict, steps: pa.Table, notes: list) -> tuple[list, list]:
    """The requests in arrival order, and when each finished in the recording (None: unknown)."""
    arrivals = _by_req(inp, "arrive", "t_ns")
    finish_step = _by_req(inp, "finish", "step")
    out_tokens = _by_req(inp, "finish", "output_tokens", max) if inp.has("finish") and "output_tokens" in inp.present.get("finish", ()) else {}
    st_end = {(r, p, s): e for r, p, s, e in zip(_col(steps, "run", ""), _col(steps, "pid", 0), _col(steps, "step"), _col(steps, "t_end_ns"))}
    st_start = {(r, p, s): e for r, p, s, e in zip(_col(steps, "run", ""), _col(steps, "pid", 0), _col(steps, "step"), _col(steps, "t_start_ns"))}
    first_step, first_row = _first_steps(load.read_table(inp, "admit"))
    # when a request finished: the end of the step before its finish record in vLLM (which reports
    # a request finished in the next step's output), of that step in SGLang (the hook sends it at
    # the end of the step that finished it)
    lag = 0 if _engine(inp) == "sglang" else 1
    reqs, finish_at, admitted = [], [], []
    missing_arrival = 0
    for k, d in chains.items():
        chain = list(itertools.chain.from_iterable(d["parts"][f] for f in sorted(d["parts"])))
        arr = arrivals.get(k)
        if not arr:
            missing_arrival += 1
            arr = st_start.get((k[0], k[1], first_step.get(k, -1)), 0)
        out = out_tokens.get(k) or d["max_out"] or 1
        reqs.append(Req(k[2], int(arr), int(d["plen"]), int(out), chain))
        fs = finish_step.get(k)
        finish_at.append(st_end.get((k[0], k[1], fs - lag)) if fs is not None else None)
        t_adm = st_start.get((k[0], k[1], first_step.get(k, -1)))
        admitted.append((t_adm is None, t_adm or 0, first_row.get(k, 0)))
    if missing_arrival:
        notes.append(f"{missing_arrival} requests have no arrive record: they arrive at their recorded first step")
    if not out_tokens:
        notes.append("output lengths are the requests' max_tokens (the finish records carry no output length)")
    # the recorded order of first admissions (by the admitting step's start, then the engine's
    # order within the step): the replay admits first admissions in this order (whatif_replay)
    for rank, i in enumerate(sorted(range(len(reqs)), key=lambda i: (*admitted[i], reqs[i].arrival, reqs[i].rid))):
        reqs[i].rank = rank
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, reqs[i].rid))
    return [reqs[i] for i in order], [finish_at[i] for i in order]


def _closed_loop(reqs: list, finish_at: list) -> int:
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


def workload(directory) -> Workload:
    inp = load.scan(directory)
    if not inp.has("prompt_blocks"):
        raise DatasetError(f"{directory} has no prompt_blocks records: whatif needs each request's prompt block hashes "
                           "(recorded by the kvtrace hook at first admission)")
    notes = [g for g in inp.gaps if "prompt_blocks" not in g and "token_causes" not in g]
    chains, b0 = _chains(directory, load.read_table(inp, "prompt_blocks"))
    steps = load.read_table(inp, "step")
    reqs, finish_at = _requests(inp, chains, steps, notes)
    closed = _closed_loop(reqs, finish_at)
    recorded = recorded_figures(inp, steps, b0)
    storage = fit(inp)
    quiet = quiet_steps(steps, inp)
    model = fit_steps(steps.filter(pa.array(quiet)) if steps.num_rows and quiet.sum() >= 3 else steps)
    recorded["ttft"] = recorded_ttft(inp, steps)
    engine = recorded["engine"]
    recorded["storage_tier"] = "file" if storage.loads else "none"
    notes = notes + [f"{closed} of {len(reqs)} requests replayed closed-loop at other settings"]
    return Workload(reqs, b0, recorded, model, notes + ([f"storage: {storage.note}"] if storage.note else []), storage,
                    engine, recorded_clock(steps, reqs, finish_at), _first_hits(inp, b0))


def _first_hits(inp: load.Inputs, block_size: int) -> dict:
    """request -> the blocks (local and storage) it hit at its first admission, as recorded."""
    adm = load.read_table(inp, "admit")
    out = {}
    for rid, att, l, e in zip(_col(adm, "request"), _col(adm, "attempt"), _col(adm, "cached_local", 0),
                              _col(adm, "cached_external", 0)):
        if att == 0 and rid not in out:
            out[rid] = ((l or 0) + (e or 0)) // block_size
    return out


def recorded_clock(steps: pa.Table, reqs: list, finish_at: list) -> list | None:
    """What each recorded step took, in the order they ran: from its start to the next step's
    start (its execution and the scheduler's work before the next), or to its own end when no
    request was left in flight after it (the engine then waited for one).  None for a dataset
    of several engines or without step times."""
    if steps.num_rows == 0 or len(set(zip(_col(steps, "run", ""), _col(steps, "pid", 0)))) != 1:
        return None
    rows = sorted(zip(_col(steps, "t_start_ns", 0), _col(steps, "t_end_ns", 0)))
    if any(a is None or b is None or b < a for a, b in rows):
        return None
    arrived = sorted(r.arrival for r in reqs)
    done = sorted(f if f else float("inf") for f in finish_at)
    clock = []
    for k, (t0, t1) in enumerate(rows):
        nxt = rows[k + 1][0] if k + 1 < len(rows) else None
        busy = bisect.bisect_right(arrived, t1) - bisect.bisect_right(done, t1)
        clock.append(nxt - t0 if nxt is not None and nxt >= t1 and busy > 0 else t1 - t0)
    return clock


def _engine(inp: load.Inputs) -> str:
    """The serving engine the hook recorded ("vllm" when no engine record: hooks before 5)."""
    names = set(_col(load.read_table(inp, "engine"), "name")) if inp.has("engine") else set()
    return "sglang" if names == {"sglang"} else "vllm"


def recorded_ttft(inp: load.Inputs, steps: pa.Table) -> dict:
    """TTFT p50/p90 of the recording as the analysis counts it (arrival to the end of the step of
    the last prefill chunk), for the table beside the predictions."""
    ch = load.read_table(inp, "chunk")
    arr = _by_req(inp, "arrive", "t_ns")
    st_end = {(r, p, s): e for r, p, s, e in zip(_col(steps, "run", ""), _col(steps, "pid", 0), _col(steps, "step"),
                                                _col(steps, "t_end_ns"))}
    last = {}
    for run, pid, rid, att, step, is_last in zip(_col(ch, "run", ""), _col(ch, "pid", 0), _col(ch, "request"),
                                                 _col(ch, "attempt", 0), _col(ch, "step"), _col(ch, "last", 0)):
        if is_last and att == 0:
            k = (run, pid, rid)
            last[k] = min(last.get(k, step), step)
    ttft = sorted(st_end[(k[0], k[1], s)] - arr[k] for k, s in last.items() if k in arr and (k[0], k[1], s) in st_end)
    if not ttft:
        return {"p50_ns": None, "p90_ns": None}
    return {"p50_ns": ttft[(len(ttft) + 1) // 2 - 1], "p90_ns": ttft[max(-(-len(ttft) * 9 // 10) - 1, 0)]}


def _new_token_ratio(inp: load.Inputs) -> float | None:
    """SGLang's new_token_ratio (its estimate of the share of max_new_tokens a running request
    will still decode, which admission reserves), the median of the scraped gauge."""
    if not inp.has("sglang_metrics"):
        return None
    m = load.read_table(inp, "sglang_metrics")
    vals = sorted(v for n, v in zip(_col(m, "name"), _col(m, "value"))
                  if n == "sglang:new_token_ratio" and v is not None)
    return float(vals[len(vals) // 2]) if vals else None


def _recorded_cache_blocks(inp: load.Inputs) -> int | None:
    """num_gpu_blocks from vLLM's cache_config_info metric, or SGLang's max_total_num_tokens,
    when it was scraped."""
    if inp.has("sglang_metrics"):
        m = load.read_table(inp, "sglang_metrics")
        vals = [v for n, v in zip(_col(m, "name"), _col(m, "value")) if n == "sglang:max_total_num_tokens"]
        if vals:
            return int(max(vals))
    if not inp.has("vllm_metrics"):
        return None
    cache_blocks = None
    m = load.read_table(inp, "vllm_metrics")
    for name, labels in zip(_col(m, "name"), _col(m, "labels")):
        if name == "vllm:cache_config_info" and labels and '"num_gpu_blocks"' in labels:
            try:
                cache_blocks = int(json.loads(labels)["num_gpu_blocks"])
            except (ValueError, KeyError, TypeError):
                pass
    return cache_blocks


def recorded_figures(inp: load.Inputs, steps: pa.Table, b0: int) -> dict:
    adm = load.read_table(inp, "admit")
    first = adm.filter(pc.equal(adm["attempt"], 0)) if adm.num_rows else adm
    seen, prompt, local, ext = set(), 0, 0, 0
    for rid, p, l, e in zip(_col(first, "request"), _col(first, "prompt_len"), _col(first, "cached_local"), _col(first, "cached_external")):
        if rid in seen:
            continue
        seen.add(rid)
        prompt, local, ext = prompt + p, local + l, ext + e
    ev = load.read_table(inp, "evict").num_rows if inp.has("evict") else 0
    pre = load.read_table(inp, "preempt").num_rows if inp.has("preempt") else 0
    tokens = _col(steps, "total_tokens", 0)
    free = _col(steps, "free_blocks", 0)
    cache_blocks = _recorded_cache_blocks(inp)
    engine = _engine(inp)
    sglang = engine == "sglang"
    return {"engine": engine, "chunk_size": max(tokens) if tokens else None, "block_size": b0,
            "cache_blocks": cache_blocks or ((max(free) + (0 if sglang else 1)) if free else None),
            "cache_blocks_from": ("sglang:max_total_num_tokens" if sglang else "vllm:cache_config_info") if cache_blocks
            else "most free slots seen" if sglang else "most free blocks seen + the null block",
            "hit_rate": (local + ext) / prompt if prompt else None, "hit_local": local, "hit_external": ext,
            "prompt_tokens": prompt, "evictions": ev, "preemptions": pre,
            "new_token_ratio": _new_token_ratio(inp) if sglang else None}


def fit_steps(steps: pa.Table) -> tuple:
    """Step duration a + b*prefill_tokens + c*decode_reqs (ns), least squares over the recorded steps."""
    if steps.num_rows == 0:
        return (5e6, 0.0, 0.0)
    dur = np.array(_col(steps, "t_end_ns", 0), dtype=float) - np.array(_col(steps, "t_start_ns", 0), dtype=float)
    x = np.column_stack([np.ones(steps.num_rows), np.array(_col(steps, "prefill_tokens", 0), float),
                         np.array(_col(steps, "decode_reqs", 0), float)])
    ok = dur > 0
    if ok.sum() < 3:
        return (float(np.median(dur[ok])) if ok.any() else 5e6, 0.0, 0.0)
    coef, *_ = np.linalg.lstsq(x[ok], dur[ok], rcond=None)
    a, b, c = (max(float(v), 0.0) for v in coef)
    return (a, b, c)
