"""`kvtrace whatif`: replay the recorded request stream through a model of vLLM's prefix cache
and scheduler (vLLM 0.32, v1 engine) under other settings, and predict what they would do.

Inputs, per request, from the hook's records: arrival (``arrive``), prompt as a chain of block
hashes (``prompt_blocks``; no token ids), output length (``finish.output_tokens`` when the
record has it, else the request's ``max_output``), and when it finished (the step before the
``finish`` record).  The model:

* KV cache: ``cache_blocks`` blocks, one of them vLLM's null block.  Free blocks form one queue;
  allocation pops its head, and a popped block that still holds a hash is an **eviction**.  A
  finished or preempted request frees its blocks tail first; blocks with a hash go to the back
  (LRU), blocks without one to the front.  Full blocks are hashed when allocated (so a request
  admitted later in the same step can hit them); output blocks get hashes no prompt shares.
* Admission (waiting queue, FCFS, only in steps without a preemption): the longest cached
  prefix, at most ``(tokens - 1) // block`` blocks; then the storage tier's consecutive blocks;
  admitted only if the whole sequence fits (vLLM's ``scheduler_reserve_full_isl``).  Hits are
  counted at first admission only, as in the analysis.
* Steps: running requests first (prefill chunks, then 1 token per decode), each within the
  chunk budget; an allocation that fails preempts the last running request.  A step lasts
  ``a + b·prefill tokens + c·decode requests`` with a, b, c fitted to the recorded steps.
* Arrivals: a request sent within 100 ms of another's finish is replayed as sent that long after
  that request finishes in the replay (a closed-loop client); others keep their recorded time.

Block sizes must be multiples of the recorded one: prompts are only known as hashes of
recorded-size blocks, and a block of k recorded blocks is named by the hash of its last one.
"""
from __future__ import annotations

import functools
import itertools
import operator
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import compress, islice, repeat, takewhile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis import load
from kvtrace.errors import DatasetError, UsageError

CLOSED_LOOP_NS = 100_000_000
_not_none = functools.partial(operator.is_not, None)


def _ints(x) -> np.ndarray:
    """Block ids as an int64 array (np.fromiter: a list of Python ints converts faster than np.array)."""
    return x if isinstance(x, np.ndarray) else np.fromiter(x, np.int64, len(x))


@dataclass
class Req:
    rid: str
    arrival: int
    prompt_len: int
    output: int
    chain: list                     # hashes of recorded-size blocks
    after: int = -1                 # index of the request whose finish triggers it (closed loop)
    gap: int = 0
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

    def distinct(self) -> dict:
        """id(chain) -> whether the chain has no hash twice (computed once for every replay)."""
        if getattr(self, "_distinct", None) is None:
            self._distinct = {id(r.chain): len(set(r.chain)) == len(r.chain) for r in self.reqs}
        return self._distinct


def _col(t: pa.Table, name: str, default=None):
    return t[name].to_pylist() if name in t.column_names else [default] * t.num_rows


def workload(directory) -> Workload:
    inp = load.scan(directory)
    if not inp.has("prompt_blocks"):
        raise DatasetError(f"{directory} has no prompt_blocks records: whatif needs each request's prompt block hashes "
                           "(recorded by the kvtrace hook at first admission)")
    notes = [g for g in inp.gaps if "prompt_blocks" not in g]
    pb = load.read_table(inp, "prompt_blocks")
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
    b0 = bsz.pop()

    def by_req(table, value, agg=min):
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

    arrivals = by_req("arrive", "t_ns")
    finish_step = by_req("finish", "step")
    out_tokens = by_req("finish", "output_tokens", max) if inp.has("finish") and "output_tokens" in inp.present.get("finish", ()) else {}
    steps = load.read_table(inp, "step")
    st_end = {(r, p, s): e for r, p, s, e in zip(_col(steps, "run", ""), _col(steps, "pid", 0), _col(steps, "step"), _col(steps, "t_end_ns"))}
    st_start = {(r, p, s): e for r, p, s, e in zip(_col(steps, "run", ""), _col(steps, "pid", 0), _col(steps, "step"), _col(steps, "t_start_ns"))}
    adm = load.read_table(inp, "admit")
    first_step = {}
    for run, pid, rid, att, s in zip(_col(adm, "run", ""), _col(adm, "pid", 0), _col(adm, "request"), _col(adm, "attempt"), _col(adm, "step")):
        if att == 0:
            first_step[(run, pid, rid)] = min(first_step.get((run, pid, rid), s), s)
    reqs, finish_at = [], []
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
        finish_at.append(st_end.get((k[0], k[1], fs - 1)) if fs is not None else None)
    if missing_arrival:
        notes.append(f"{missing_arrival} requests have no arrive record: they arrive at their recorded first step")
    if not out_tokens:
        notes.append("output lengths are the requests' max_tokens (the finish records carry no output length)")
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, reqs[i].rid))
    reqs = [reqs[i] for i in order]
    finish_at = [finish_at[i] for i in order]
    # closed loop: sent right after another request finished
    fin_sorted = sorted((f, i) for i, f in enumerate(finish_at) if f)
    closed = 0
    import bisect
    keys = [f for f, _ in fin_sorted]
    for i, r in enumerate(reqs):
        j = bisect.bisect_right(keys, r.arrival) - 1
        if j >= 0 and r.arrival - keys[j] <= CLOSED_LOOP_NS and fin_sorted[j][1] != i:
            r.after, r.gap = fin_sorted[j][1], r.arrival - keys[j]
            closed += 1
    recorded = recorded_figures(inp, steps, b0)
    return Workload(reqs, b0, recorded, fit_steps(steps), notes + [f"{closed} of {len(reqs)} requests replayed closed-loop"])


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
    cache_blocks = None
    if inp.has("vllm_metrics"):
        m = load.read_table(inp, "vllm_metrics")
        for name, labels in zip(_col(m, "name"), _col(m, "labels")):
            if name == "vllm:cache_config_info" and labels and '"num_gpu_blocks"' in labels:
                import json
                try:
                    cache_blocks = int(json.loads(labels)["num_gpu_blocks"])
                except (ValueError, KeyError, TypeError):
                    pass
    return {"chunk_size": max(tokens) if tokens else None, "block_size": b0,
            "cache_blocks": cache_blocks or ((max(free) + 1) if free else None),
            "cache_blocks_from": "vllm:cache_config_info" if cache_blocks else "most free blocks seen + the null block",
            "hit_rate": (local + ext) / prompt if prompt else None, "hit_local": local, "hit_external": ext,
            "prompt_tokens": prompt, "evictions": ev, "preemptions": pre}


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


class Tier:
    """A KV connector's store: every computed block is written; a prefix is loaded back at admission."""

    def __init__(self, spec: str):
        self.name = spec
        kind, _, cap = spec.partition(":")
        if kind not in ("file", "none"):
            raise UsageError(f"--storage-tier {spec!r}: give none or file[:BLOCKS]")
        self.on = kind == "file"
        try:
            self.cap = int(cap) if cap else None
        except ValueError:
            raise UsageError(f"--storage-tier {spec!r}: BLOCKS must be a whole number") from None
        self.keys: OrderedDict = OrderedDict()

    def store(self, key) -> None:
        if not self.on or key in self.keys:
            return
        self.keys[key] = None
        if self.cap is not None and len(self.keys) > self.cap:
            self.keys.popitem(last=False)


class FreeQueue:
    """vLLM's free-block queue: pop from the front, put back at either end, take out from the
    middle (a hit on an idle cached block), all in order.  Kept as a numpy array of entries
    version * n + block with lazy removal: a block's entry is live while the block is free and
    the entry carries the block's current version (bumped each time the block is put back), so
    taking a request's blocks out or putting them back is a few array operations, not one Python
    step per block.  Dead entries are skipped at the front, and all dropped at once when they
    outnumber the live ones."""

    def __init__(self, n: int):
        self.n = n
        self.ver = np.zeros(n, dtype=np.int64)
        self.isfree = np.ones(n, dtype=bool)
        self.count = n
        self._place(np.arange(n, dtype=np.int64))

    def __len__(self) -> int:
        return self.count

    def _place(self, live: np.ndarray) -> None:
        """A new array holding the live entries in order, with room at both ends."""
        room = max(len(live), self.n) + 4096
        self.buf = np.empty(len(live) + 2 * room, dtype=np.int64)
        self.lo, self.hi = room, room + len(live)
        self.buf[self.lo:self.hi] = live

    def _live(self, e: np.ndarray) -> np.ndarray:
        b = e % self.n
        return self.isfree[b] & (self.ver[b] * self.n + b == e)

    def _compact(self) -> None:
        e = self.buf[self.lo:self.hi]
        self._place(e[self._live(e)])

    def pop(self, k: int) -> list:
        """The k blocks at the front, front first (k <= len(self))."""
        out: list = []
        while len(out) < k:
            want = k - len(out)
            e = self.buf[self.lo:min(self.hi, self.lo + 2 * want + 64)]
            if not len(e):
                raise IndexError("pop from an empty free-block queue")
            idx = np.flatnonzero(self._live(e))[:want]
            self.lo += int(idx[-1]) + 1 if len(idx) == want else len(e)
            b = e[idx] % self.n
            self.isfree[b] = False
            self.count -= len(b)
            out.extend(b.tolist())
        return out

    def _entries(self, bids) -> np.ndarray:
        bids = _ints(bids)
        self.ver[bids] += 1
        self.isfree[bids] = True
        self.count += len(bids)
        return self.ver[bids] * self.n + bids

    def extend(self, bids) -> None:
        """Put distinct blocks (none of them free) at the back, in order."""
        if not len(bids):
            return
        e = self._entries(bids)
        if self.hi + len(e) > len(self.buf) or self.hi - self.lo > 4 * self.count + 4096:
            self._compact()
            if self.hi + len(e) > len(self.buf):
                self._place(self.buf[self.lo:self.hi])
        self.buf[self.hi:self.hi + len(e)] = e
        self.hi += len(e)

    def extend_front(self, bids) -> None:
        """Put distinct blocks (none of them free) at the front, bids[0] first."""
        if not len(bids):
            return
        e = self._entries(bids)
        if self.lo < len(e):
            self._compact()
            if self.lo < len(e):
                self._place(self.buf[self.lo:self.hi])
        self.buf[self.lo - len(e):self.lo] = e
        self.lo -= len(e)

    def remove(self, bids) -> None:
        """Take distinct free blocks out of the queue wherever they are."""
        bids = _ints(bids)
        self.isfree[bids] = False
        self.count -= len(bids)


class Replay:
    def __init__(self, wl: Workload, chunk: int, block: int, cache_blocks: int, tier: str = "none", max_num_seqs: int = 256):
        if block % wl.block_size:
            raise UsageError(f"--block-size {block}: must be a multiple of the recorded block size {wl.block_size} "
                             "(prompts are known only as hashes of recorded-size blocks)")
        if cache_blocks < 2:
            raise UsageError(f"--cache-blocks {cache_blocks}: at least 2 (one is vLLM's null block)")
        self.wl, self.C, self.B, self.N = wl, chunk, block, cache_blocks
        self.m = block // wl.block_size
        self.tier = Tier(tier)
        self.max_seqs = max_num_seqs
        n = cache_blocks - 1
        self.free = FreeQueue(n)
        self.bhash: list = [None] * n
        self.ref = np.zeros(n, dtype=np.int64)
        self.cached: dict = {}               # key -> [block ids holding it]
        self.head: dict = {}                 # key -> the first of them (the one a hit takes)
        self.ever: set = set()               # keys ever computed (recompute accounting)
        self.stats = dict(requests=0, prompt_tokens=0, hit_local=0, hit_external=0, evictions=0, storage_loads=0,
                          preemptions=0, prefill_tokens=0, recomputed_tokens=0, readmit_hits=0, steps=0, lookups=0)

    # ---- block pool ----
    def _alloc(self, r: Req, upto: int) -> None:
        """Give r blocks up to index upto (exclusive), evicting cached blocks popped from the free queue."""
        free, bhash, cached, head, ref = self.free, self.bhash, self.cached, self.head, self.ref
        k0 = upto - len(r.blocks)
        if k0 <= 0:
            return
        for bid in free.pop(k0):
            k = bhash[bid]
            if k is not None:
                d = cached[k]
                if len(d) == 1:
                    del cached[k]
                    del head[k]
                else:
                    d.remove(bid)
                    head[k] = d[0]
                bhash[bid] = None
                self.stats["evictions"] += 1
            ref[bid] = 1
            r.blocks.append(bid)

    def _hash_full(self, r: Req, tokens: int, loaded_upto: int = 0) -> None:
        """Hash r's full blocks below `tokens` (vLLM caches them at allocation)."""
        B, bhash, cached, ever = self.B, self.bhash, self.cached, self.ever
        upto = min(tokens, r.num_tokens) // B
        for j in range(r.hashed, upto):
            bid = r.blocks[j]
            if bhash[bid] is not None:  # a hit block: cached already
                continue
            if j >= len(r.keys):  # a block holding output tokens: no other prompt has its hash
                r.keys.append(("o", id(r), j))
            k = r.keys[j]
            bhash[bid] = k
            if k in cached:
                cached[k].append(bid)
            else:
                cached[k] = [bid]
                self.head[k] = bid
            if j >= loaded_upto:
                if k in ever:
                    self.stats["recomputed_tokens"] += B
                else:
                    ever.add(k)
                if self.tier.on:
                    self.tier.store(k)
        if upto > r.hashed:
            r.hashed = upto

    def _free(self, r: Req) -> None:
        """Tail first: blocks with a hash to the back of the free queue (LRU), others to the front."""
        ref, bhash, free = self.ref, self.bhash, self.free
        first = []
        if r.distinct:
            # a request's blocks at once (no block twice among them)
            tail = np.fromiter(reversed(r.blocks), np.int64, len(r.blocks))
            ref[tail] -= 1
            freed = tail[ref[tail] == 0]
            hs = list(map(bhash.__getitem__, freed.tolist()))
            if None in hs:
                freed = freed.tolist()
                free.extend(list(compress(freed, map(operator.is_not, hs, repeat(None)))))
                first = list(compress(freed, map(operator.is_, hs, repeat(None))))
            else:
                free.extend(freed)
        else:
            for bid in reversed(r.blocks):
                c = ref[bid] - 1
                ref[bid] = c
                if not c:
                    if bhash[bid] is None:
                        first.append(bid)
                    else:
                        free.extend([bid])
        # unhashed blocks to the front, the request's first of them frontmost
        free.extend_front(first)
        r.blocks = []
        r.hashed = 0

    # ---- scheduler ----
    def _admit(self, r: Req, budget: int, busy: bool) -> int:
        """Try to admit r; the tokens scheduled, or 0 when it does not fit."""
        B, cached = self.B, self.cached
        cap = (r.num_tokens - 1) // B
        keys = r.keys
        lim = min(cap, len(keys))
        # the longest cached prefix: one lookup per block until the first miss (C iterators, no
        # Python step per block), giving the block each hit takes
        hit_blocks = list(takewhile(_not_none, map(self.head.get, islice(keys, lim))))
        hit = len(hit_blocks)
        self.stats["lookups"] += hit + (1 if hit < lim else 0)
        ext = 0
        if self.tier.on:
            ext = len(list(takewhile(self.tier.keys.__contains__, islice(keys, hit, lim))))
        computed = (hit + ext) * B
        n = min(r.num_tokens - computed, budget)
        ref = self.ref
        free = self.free
        if r.distinct:
            hb = _ints(hit_blocks)
            idle = ref[hb] == 0
            evictable = int(idle.sum())
            need_all = -(-r.num_tokens // B) - hit + evictable
            if need_all > len(free):
                return 0
            if evictable:
                free.remove(hb[idle])
            ref[hb] += 1
        else:
            evictable = sum(1 for b in hit_blocks if not ref[b])
            need_all = -(-r.num_tokens // B) - hit + evictable
            if need_all > len(free):
                return 0
            for b in hit_blocks:
                if not ref[b]:
                    free.remove([b])
                ref[b] += 1
        r.blocks = hit_blocks
        self._alloc(r, -(-(computed + n) // B))
        if r.attempt == 0 and not r.admitted:
            s = self.stats
            s["requests"] += 1
            s["prompt_tokens"] += r.prompt_len
            s["hit_local"] += hit * B
            s["hit_external"] += ext * B
        else:
            self.stats["readmit_hits"] += (hit + ext) * B
        r.admitted = True
        self.stats["storage_loads"] += ext
        if ext:
            deque(map(self.tier.keys.move_to_end, keys[hit:hit + ext]), 0)
        r.computed = computed
        r.hashed = hit  # hit blocks carry their hash already
        self._hash_full(r, computed + n, loaded_upto=hit + ext)
        return n

    def run(self) -> dict:
        wl, B, m = self.wl, self.B, self.m
        reqs = [Req(r.rid, r.arrival, r.prompt_len, r.output, r.chain, r.after, r.gap) for r in wl.reqs]
        distinct = wl.distinct()  # a chain without a repeated hash has none in any slice
        for r in reqs:
            r.keys = r.chain[m - 1::m][: r.prompt_len // B]
            r.distinct = distinct[id(r.chain)]
            r.num_tokens = r.prompt_len
        a, b, c = wl.model
        pending = sorted((r.arrival, i) for i, r in enumerate(reqs) if r.after < 0)
        triggered: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.after >= 0:
                triggered.setdefault(r.after, []).append(i)
        import heapq
        heapq.heapify(pending)
        waiting: deque = deque()
        running: list = []
        now = pending[0][0] if pending else 0
        done = 0
        t_start = now
        while done < len(reqs):
            while pending and pending[0][0] <= now:
                _, i = heapq.heappop(pending)
                reqs[i].arrived_ns = reqs[i].arrival
                waiting.append(reqs[i])
            if not waiting and not running:
                if not pending:
                    break  # a closed-loop request whose trigger never finished
                now = pending[0][0]
                continue
            budget = self.C
            sched: list = []
            preempted = False
            i = 0
            while i < len(running) and budget > 0:
                r = running[i]
                n = min(r.num_tokens - r.computed, budget)
                need = -(-(r.computed + n) // B)
                ok = True
                while need - len(r.blocks) > len(self.free):
                    victim = running.pop()
                    self._preempt(victim, waiting)
                    preempted = True
                    if victim is r:
                        ok = False
                        break
                if not ok:
                    break
                self._alloc(r, need)
                self._hash_full(r, r.computed + n)
                sched.append((r, n))
                budget -= n
                i += 1
            if not preempted:
                while budget > 0 and waiting and len(running) < self.max_seqs:
                    r = waiting[0]
                    n = self._admit(r, budget, bool(running))
                    if not n:
                        break
                    waiting.popleft()
                    running.append(r)
                    sched.append((r, n))
                    budget -= n
            if not sched:
                # nothing fits (a request larger than the cache): drop it, as vLLM would reject it
                if waiting and not running:
                    r = waiting.popleft()
                    r.done_ns = now
                    done += 1
                    self.stats.setdefault("unservable", 0)
                    self.stats["unservable"] += 1
                    continue
                now = pending[0][0] if pending else now + 1_000_000
                continue
            kinds = [r.generated == 0 or r.num_tokens - r.computed > 1 for r, _ in sched]
            prefill = sum(n for (r, n), pf in zip(sched, kinds) if pf)
            decode = len(sched) - sum(kinds)
            now += int(a + b * prefill + c * decode)
            self.stats["steps"] += 1
            self.stats["prefill_tokens"] += prefill
            finished = []
            for r, n in sched:
                r.computed += n
                if r.computed >= r.num_tokens:
                    r.generated += 1
                    if r.generated == 1 and not r.first_token_ns:
                        r.first_token_ns = now
                    if r.generated >= r.output:
                        finished.append(r)
                    else:
                        r.num_tokens += 1
            for r in finished:
                running.remove(r)
                self._free(r)
                r.done_ns = now
                done += 1
                for j in triggered.get(self._index(reqs, r), []):
                    heapq.heappush(pending, (now + reqs[j].gap, j))
        s = dict(self.stats)
        s["hit_rate"] = (s["hit_local"] + s["hit_external"]) / s["prompt_tokens"] if s["prompt_tokens"] else None
        s["replayed_ns"] = now - t_start
        ttft = sorted(r.first_token_ns - r.arrived_ns for r in reqs if r.first_token_ns)
        s["ttft_p50_ns"] = ttft[(len(ttft) + 1) // 2 - 1] if ttft else None
        return s

    def _index(self, reqs, r) -> int:
        if not hasattr(self, "_idx"):
            self._idx = {id(x): i for i, x in enumerate(reqs)}
        return self._idx[id(r)]

    def _preempt(self, r: Req, waiting: deque) -> None:
        self._free(r)
        r.computed = 0
        r.attempt += 1
        self.stats["preemptions"] += 1
        waiting.appendleft(r)


def run(directory, chunk_sizes=None, block_sizes=None, cache_blocks=None, tiers=None, max_num_seqs: int = 256) -> dict:
    wl = workload(directory)
    rec = wl.recorded
    if not wl.reqs:
        raise DatasetError(f"{directory}: no requests to replay")
    chunk_sizes = chunk_sizes or ([rec["chunk_size"]] if rec["chunk_size"] else None)
    cache_blocks = cache_blocks or ([rec["cache_blocks"]] if rec["cache_blocks"] else None)
    if not chunk_sizes:
        raise UsageError("give --chunk-size: the dataset has no step records to read the recorded chunk budget from")
    if not cache_blocks:
        raise UsageError("give --cache-blocks: the dataset does not tell the recorded KV cache size")
    block_sizes = block_sizes or [wl.block_size]
    tiers = tiers or ["none"]
    rows = []
    for C, B, N, T in itertools.product(chunk_sizes, block_sizes, cache_blocks, tiers):
        t0 = time.perf_counter()
        rp = Replay(wl, C, B, N, T, max_num_seqs)
        s = rp.run()
        dt = time.perf_counter() - t0
        rows.append({"chunk_size": C, "block_size": B, "cache_blocks": N, "storage_tier": T, **s,
                     "replay_s": round(dt, 4), "lookups_per_s": round(s["lookups"] / dt) if dt else None})
    return {"dataset": str(directory), "requests": len(wl.reqs), "recorded": rec,
            "step_model_ns": {"a": wl.model[0], "per_prefill_token": wl.model[1], "per_decode_request": wl.model[2]},
            "notes": wl.notes, "predictions": rows}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    rec = res["recorded"]
    c.print(f"recorded: {res['requests']} requests, chunk budget ≥ {rec['chunk_size']}, block size {rec['block_size']}, "
            f"{rec['cache_blocks']} cache blocks ({rec['cache_blocks_from']}); hit rate "
            f"{_pct(rec['hit_rate'])}, {rec['evictions']:,} evictions, {rec['preemptions']} preemptions")
    t = Table(title="whatif: predictions per setting")
    for col in ("chunk", "block", "cache blocks", "tier", "hit rate", "hit tokens (local+storage)", "recomputed tokens",
                "evictions", "storage loads (blocks)", "preemptions", "steps"):
        t.add_column(col, justify="right")
    for r in res["predictions"]:
        t.add_row(str(r["chunk_size"]), str(r["block_size"]), str(r["cache_blocks"]), r["storage_tier"],
                  "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.2f}%",
                  f"{r['hit_local']:,}+{r['hit_external']:,}", f"{r['recomputed_tokens']:,}", f"{r['evictions']:,}",
                  f"{r['storage_loads']:,}", str(r["preemptions"]), f"{r['steps']:,}")
    c.print(t)
    for n in res["notes"]:
        c.print(f"note: {n}")
