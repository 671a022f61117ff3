"""Prefill/decode pairs: one request served by two engines (a prefill server that computes the
prompt's KV and hands it over a KV connector, a decode server that loads it and generates),
found in a dataset of one run or of several hosts' runs, and the hosts' clocks put on one
timeline from the requests that cross them.

Pairing, from the hook's records alone (any connector, any proxy or router in front):
  decode side   a request granted tokens to load from its connector (kv_alloc, external > 0)
  prefill side  a request of another engine handed to its connector at its end (kv_finish)
with the same prompt: its length and the last hash of its block-hash chain (prompt_blocks; vLLM's
hashes are equal across servers of one model).  A request id both sides share (a proxy that
sends one X-Request-Id to both, as vLLM's does) pairs first; the rest pair in their order on
each side's own clock, so no clock is trusted to pair.

Clocks: each run's rows are on its host's CLOCK_MONOTONIC, put on wall time by the run's
clock_offset_ns; two hosts' wall clocks differ by their synchronisation error.  For a decode
host against its prefill host, every pair bounds that difference (theta = decode wall - prefill
wall, for the same instant):
  the prefill finished before the decode server got the request: theta < d_arrive - p_finish
  the decode server granted the pull before the prefill side saw it done (kv_done store):
                                                              theta > d_alloc - p_sent
The estimate is the middle of the tightest bounds, its error bound half their width.  Runs on
one host share its clock: no shift.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvtrace.correlate import ids


@dataclass
class Side:
    run: str
    host: str
    pid: int
    request: str
    arrive_ns: int = 0      # own monotonic clock
    traceparent: str = ""


@dataclass
class Pair:
    p: Side
    d: Side
    how: str                # "request id" or "prompt"
    p_finish_ns: int        # kv_finish on the prefill side (own clock)
    p_sent_ns: int          # its kv_done store (0: none seen)
    d_alloc_ns: int         # kv_alloc on the decode side (own clock)
    d_loaded_ns: int        # its kv_done load (0: none seen)
    blocks: tuple[int, int] = (0, 0)      # handed over (prefill), loaded (decode)
    nbytes: tuple[int, int] = (0, 0)
    connector: str = ""
    transport: tuple[int, int] | None = None   # the decode side's transport calls and their bytes
                                               # in its pull (ulib_calls; None: not traced)


@dataclass
class Shift:
    """A host's clock against the reference host: subtract shift_ns from its wall times."""
    host: str
    reference: str
    shift_ns: int
    error_ns: int | None    # None: no bound (no pair crosses to the reference)
    lo_ns: int | None = None
    hi_ns: int | None = None
    pairs: int = 0


@dataclass
class _Req:
    side: Side
    key: tuple | None
    finish: dict | None = None
    sent: int = 0
    alloc: dict | None = None
    loaded: int = 0


def prompt_key(r: dict) -> tuple | None:
    """A prompt_blocks record's key for pairing (its prompt's length and last block hash), from
    the record that holds the last hash; None from the others and for prompts under a block."""
    hs = r["hashes"] or []
    return (r["prompt_len"], hs[-1]) if hs and r["first"] + len(hs) == r["num_blocks"] else None


def traceparent_of(run: str, request: str, own: str) -> str:
    """The W3C traceparent naming a request's span in its trace (its own trace context, else
    kvtrace's): what its decode side is handed."""
    trace, _, _ = ids.trace_of(run, request, own)
    return f"00-{trace.hex()}-{ids.request_span(trace, request).hex()}-01"


def _rows(ds, name: str, info) -> list[dict]:
    return ds.table(name, run=info.run, host=info.host, partitions=False).to_pylist()


def _requests(ds, info) -> list[_Req]:
    """The run's requests that took part in a hand-over (kv_finish or a kv_alloc with external
    tokens), with their prompt key."""
    finish, alloc = _rows(ds, "kv_finish", info), _rows(ds, "kv_alloc", info)
    if not finish and not alloc:
        return []
    keys: dict[tuple, tuple] = {}
    for r in _rows(ds, "prompt_blocks", info):
        k = prompt_key(r)
        if k is not None:
            keys[(r["pid"], r["request"])] = k
    arrive = {(r["pid"], r["request"]): r for r in _rows(ds, "arrive", info)}
    out: dict[tuple, _Req] = {}

    def req(pid: int, rid: str) -> _Req:
        k = (pid, rid)
        if k not in out:
            a = arrive.get(k) or {}
            out[k] = _Req(Side(info.run, info.host, pid, rid, int(a.get("t_ns") or 0), a.get("traceparent") or ""),
                          keys.get(k))
        return out[k]

    for r in finish:
        if r["blocks"]:
            req(r["pid"], r["request"]).finish = r
    for r in alloc:
        if r["external"]:
            q = req(r["pid"], r["request"])
            q.alloc = q.alloc or r
    for r in _rows(ds, "kv_done", info):
        q = out.get((r["pid"], r["request"]))
        if q is None or not r["ok"]:
            continue
        if r["direction"] == "store" and not q.sent:
            q.sent = int(r["t_ns"])
        elif r["direction"] == "load" and not q.loaded:
            q.loaded = int(r["t_ns"])
    return list(out.values())


def pairs(ds, infos) -> list[Pair]:
    """Every prefill/decode pair of the dataset's runs (kvtrace.correlate.derive.runs_of)."""
    reqs = [q for info in infos for q in _requests(ds, info)]
    prefill = [q for q in reqs if q.finish is not None and q.key is not None]
    decode = [q for q in reqs if q.alloc is not None and q.key is not None]
    used: set[int] = set()
    out = []
    by_id = defaultdict(list)
    for q in prefill:
        by_id[(ids.external_id(q.side.request), q.key)].append(q)
    rest = []
    for d in sorted(decode, key=lambda q: q.side.arrive_ns):
        p = next((p for p in by_id.get((ids.external_id(d.side.request), d.key), [])
                  if id(p) not in used and _other(p, d)), None)
        if p is None:
            rest.append(d)
            continue
        used.add(id(p))
        out.append(_pair(p, d, "request id"))
    by_key = defaultdict(list)
    for q in sorted(prefill, key=lambda q: int(q.finish["t_ns"])):
        if id(q) not in used:
            by_key[q.key].append(q)
    for d in rest:
        p = next((p for p in by_key.get(d.key, []) if id(p) not in used and _other(p, d)), None)
        if p is not None:
            used.add(id(p))
            out.append(_pair(p, d, "prompt"))
    return out


def transport(ds, infos, found: list[Pair]) -> None:
    """Each pair's transport calls as the decode side's uprobes saw them (`--uprobe ucx|nixl`:
    ulib_calls of the decode run between its grant and its load done; a call in several pairs'
    windows goes to the one granted last before it)."""
    by_run = defaultdict(list)
    for x in found:
        if x.d_loaded_ns:
            by_run[(x.d.run, x.d.host)].append(x)
    for info in infos:
        pulls = sorted(by_run.get((info.run, info.host), []), key=lambda x: x.d_alloc_ns)
        if not pulls:
            continue
        calls = ds.table("ulib_calls", run=info.run, host=info.host, partitions=False)
        if not calls.num_rows:
            continue
        acc = {id(x): [0, 0] for x in pulls}
        starts = [x.d_alloc_ns for x in pulls]
        for t, b in zip(calls["entry_ns"].to_pylist(), calls["bytes"].to_pylist()):
            i = _last_le(starts, t)
            x = next((y for y in reversed(pulls[:i + 1]) if y.d_alloc_ns <= t <= y.d_loaded_ns), None)
            if x is not None:
                acc[id(x)][0] += 1
                acc[id(x)][1] += int(b or 0)
        for x in pulls:
            x.transport = tuple(acc[id(x)])


def _last_le(xs: list[int], t: int) -> int:
    import bisect
    return bisect.bisect_right(xs, t) - 1


def _other(p: _Req, d: _Req) -> bool:
    return (p.side.run, p.side.host, p.side.pid) != (d.side.run, d.side.host, d.side.pid)


def _pair(p: _Req, d: _Req, how: str) -> Pair:
    return Pair(p.side, d.side, how, int(p.finish["t_ns"]), p.sent, int(d.alloc["t_ns"]), d.loaded,
                (int(p.finish["blocks"]), int(d.alloc["blocks"])), (int(p.finish["nbytes"]), int(d.alloc["nbytes"])),
                d.alloc["connector"] or "")


def align(found: list[Pair], offsets: dict[tuple[str, str], int]) -> dict[str, Shift]:
    """Per host, its shift against the reference host (the one most pairs prefill on).
    offsets: (run, host) -> the run's clock_offset_ns (wall - monotonic)."""
    if not found:
        return {}
    count = defaultdict(int)
    for x in found:
        count[x.p.host] += 1
    ref = max(sorted(count), key=lambda h: count[h])
    bounds: dict[str, list] = defaultdict(lambda: [None, None, 0])
    for x in found:
        if {x.p.host, x.d.host} == {ref} or ref not in (x.p.host, x.d.host):
            continue
        po, do = offsets.get((x.p.run, x.p.host), 0), offsets.get((x.d.run, x.d.host), 0)
        hi = (x.d.arrive_ns + do) - (x.p_finish_ns + po) if x.d.arrive_ns else None
        lo = (x.d_alloc_ns + do) - (x.p_sent_ns + po) if x.p_sent_ns else None
        host, sign = (x.d.host, 1) if x.p.host == ref else (x.p.host, -1)
        if sign < 0:
            lo, hi = (-hi if hi is not None else None), (-lo if lo is not None else None)
        b = bounds[host]
        b[0] = lo if b[0] is None or (lo is not None and lo > b[0]) else b[0]
        b[1] = hi if b[1] is None or (hi is not None and hi < b[1]) else b[1]
        b[2] += 1
    hosts = {h for x in found for h in (x.p.host, x.d.host)}
    out = {ref: Shift(ref, ref, 0, 0)}
    for h in sorted(hosts - {ref}):
        lo, hi, n = bounds[h] if h in bounds else (None, None, 0)
        if lo is not None and hi is not None:
            out[h] = Shift(h, ref, (lo + hi) // 2, (hi - lo) // 2, lo, hi, n)
        else:
            one = lo if lo is not None else hi
            out[h] = Shift(h, ref, one or 0, None, lo, hi, n)
    return out


def handoffs(found: list[Pair]) -> dict[tuple[str, str], dict[str, str]]:
    """(run, host) -> {decode request: the W3C traceparent of its prefill request's span}: the
    context a proxy would have passed, so the decode side's spans join the prefill's trace.  A
    decode request that carried a traceparent of its own keeps it."""
    out: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for x in found:
        if x.d.traceparent:
            continue
        out[(x.d.run, x.d.host)][x.d.request] = traceparent_of(x.p.run, x.p.request, x.p.traceparent)
    return dict(out)


def rows(found: list[Pair], shifts: dict[str, Shift], offsets: dict[tuple[str, str], int],
         requests: dict[tuple[str, str], dict]) -> dict[tuple[str, str], list[dict]]:
    """The handovers rows per decode (run, host): each side's times on the reference host's wall
    clock and TTFT split as
      queue         prefill server: arrival -> first scheduled
      prefill       first scheduled -> its prefill's end (the KV complete)
      handoff       -> the decode server's arrival (the prefill's response, the proxy)
      pull          -> the decode server's load done (kv_done; for a load in the step, its first step)
      first decode  -> the decode server's first token
    which sum to TTFT: the prefill server's arrival to the decode server's first token.
    requests: (run, host) -> {(engine pid, request): requests row} (kvtrace.correlate.requests)."""
    out: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for x in found:
        pr = requests.get((x.p.run, x.p.host), {}).get((x.p.pid, x.p.request))
        dr = requests.get((x.d.run, x.d.host), {}).get((x.d.pid, x.d.request))
        if pr is None or dr is None:
            continue
        ps, ds_ = shifts.get(x.p.host), shifts.get(x.d.host)

        def on(t, side, sh):
            return int(t) + offsets.get((side.run, side.host), 0) - (sh.shift_ns if sh else 0) if t else None

        t = [on(pr["arrival_ns"], x.p, ps), on(pr["first_scheduled_ns"], x.p, ps), on(pr["prefill_end_ns"], x.p, ps),
             on(dr["arrival_ns"], x.d, ds_), on(x.d_loaded_ns or dr["first_scheduled_ns"], x.d, ds_),
             on(dr["prefill_end_ns"], x.d, ds_)]
        parts = [b - a if a is not None and b is not None else None for a, b in zip(t, t[1:])]
        err = None
        if ps is not None and ds_ is not None and ps.error_ns is not None and ds_.error_ns is not None:
            err = ps.error_ns + ds_.error_ns if x.p.host != x.d.host else 0
        out[(x.d.run, x.d.host)].append({
            "d_pid": x.d.pid, "d_request": x.d.request, "p_run": x.p.run, "p_host": x.p.host, "p_pid": x.p.pid,
            "p_request": x.p.request, "how": x.how, "connector": x.connector, "p_blocks": x.blocks[0],
            "d_transport_calls": x.transport[0] if x.transport else None,
            "d_transport_bytes": x.transport[1] if x.transport else None,
            "p_bytes": x.nbytes[0], "d_blocks": x.blocks[1], "d_bytes": x.nbytes[1],
            "clock_shift_ns": (ds_.shift_ns if ds_ else 0) - (ps.shift_ns if ps else 0), "clock_error_ns": err,
            "p_arrival_ns": t[0], "p_first_scheduled_ns": t[1], "p_prefill_end_ns": t[2], "d_arrival_ns": t[3],
            "d_loaded_ns": t[4], "d_first_token_ns": t[5], "queue_ns": parts[0], "prefill_ns": parts[1],
            "handoff_ns": parts[2], "pull_ns": parts[3], "first_decode_ns": parts[4],
            "ttft_ns": t[5] - t[0] if t[0] is not None and t[5] is not None else None})
    return dict(out)
