"""The replay's scheduler (kvtrace/analysis/whatif.py has the model it follows): admission from
the waiting queue, prefill chunks and decodes within the chunk budget, preemption, the step
clock; over the block pool of kvtrace/analysis/whatif_cache.py.

The clock and the order (docs/analysis.md, "The replay's order"): at the recorded setting
(chunk budget, block size, cache size and storage tier as recorded) every request arrives at its
recorded time, the replay's k-th step lasts as long as the recording's k-th step
(whatif_workload.recorded_clock) and first admissions keep the recorded order, so the replay
gives the recorded run back; at any other setting the fitted step model times the steps,
closed-loop requests are re-timed to their trigger's replayed finish and the queue is in the
replay's own arrival order."""
from __future__ import annotations

import functools
import heapq
import operator
from collections import deque
from itertools import islice, takewhile

from kvtrace.analysis.whatif_cache import BlockPool, _ints
from kvtrace.analysis.whatif_workload import Req, Workload
from kvtrace.errors import UsageError

_not_none = functools.partial(operator.is_not, None)


class Waiting:
    """The waiting queue.  Requests back from a preemption (or SGLang's retraction) come first,
    as the engines put them at the front; then the others in the order they arrived or, when
    ``ordered`` (the replay at the recorded setting), in the recorded order of first admissions:
    the head is then the request the recording admitted next, once it has arrived, and one that
    arrived before it waits (docs/analysis.md, "The replay's order").  False when no request may
    be admitted now."""

    __slots__ = ("back", "ready", "next", "ordered")

    def __init__(self, ordered: bool = False):
        self.back: deque = deque()   # re-admissions, front first
        self.ready: dict = {}        # arrived and not yet admitted: rank -> request (ordered), else in arrival order
        self.next = 0                # ordered: the rank admitted next
        self.ordered = ordered

    def append(self, r: Req) -> None:
        self.ready[r.rank if self.ordered else id(r)] = r

    def appendleft(self, r: Req) -> None:
        self.back.appendleft(r)

    def _head(self):
        if self.back:
            return self.back[0]
        if not self.ordered:
            return next(iter(self.ready.values()), None)
        return self.ready.get(self.next)

    def __bool__(self) -> bool:
        return self._head() is not None

    def __getitem__(self, i: int) -> Req:
        r = self._head()
        if i or r is None:
            raise IndexError(i)
        return r

    def popleft(self) -> Req:
        if self.back:
            return self.back.popleft()
        if not self.ordered:
            return self.ready.pop(next(iter(self.ready)))
        r = self.ready.pop(self.next)
        self.next = r.rank + 1
        return r

    def queued(self) -> list:
        """Every request waiting, in the queue's order."""
        rest = (self.ready[k] for k in sorted(self.ready)) if self.ordered else self.ready.values()
        return [*self.back, *rest]

    def blocked(self) -> bool:
        """Requests have arrived, but not the next in the recorded order."""
        return not self._head() and bool(self.ready)

    def unblock(self) -> None:
        """The next in the recorded order will never come (its closed-loop trigger was dropped):
        go on with the earliest one that has arrived."""
        self.next = min(self.ready)


class Replay(BlockPool):
    def __init__(self, wl: Workload, chunk: int, block: int, cache_blocks: int, tier: str = "none", max_num_seqs: int = 256):
        if block % wl.block_size:
            raise UsageError(f"--block-size {block}: must be a multiple of the recorded block size {wl.block_size} "
                             "(prompts are known only as hashes of recorded-size blocks)")
        super().__init__(block, cache_blocks, tier)
        self.wl, self.C = wl, chunk
        self.m = block // wl.block_size
        self.max_seqs = max_num_seqs
        t = self.tier
        if t.on and t.gbps is not None and not wl.storage.block_bytes:
            raise UsageError(f"--storage-tier {tier}: the dataset records no KV connector transfer to size a block by; "
                             "record a run with a connector, or give the tier without a speed (file)")
        # a loaded block's time (kvtrace.analysis.whatif_storage), scaled to this block size
        self.load_ns = wl.storage.per_block_ns(t.gbps, t.latency_us) * self.m if t.on else 0.0
        self.wait_ns = 0.0
        # at the recorded setting the replay keeps the recording's time (docs/analysis.md, "The
        # replay's order"): recorded arrivals, and each step as long as the recording's step at
        # its place; elsewhere the step model and the closed-loop clients decide
        self.clock = self._recorded_clock(chunk, block, cache_blocks, tier)

    def _recorded_clock(self, chunk: int, block: int, cache_blocks: int, tier: str) -> list | None:
        """The recorded steps' times when these are the recorded settings, else None."""
        wl = self.wl
        rec = wl.recorded
        same = (chunk, block, cache_blocks, tier) == (rec.get("chunk_size"), wl.block_size, rec.get("cache_blocks"),
                                                      rec.get("storage_tier", "none"))
        return wl.clock if same and wl.clock else None

    def _admit(self, r: Req, budget: int, busy: bool) -> int:
        """Try to admit r; the tokens scheduled, or 0 when it does not fit."""
        B = self.B
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
        if not self._take_hits(r, hit_blocks):
            return 0
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
        self.wait_ns += ext * self.load_ns
        if ext:
            deque(map(self.tier.keys.move_to_end, keys[hit:hit + ext]), 0)
        r.computed = computed
        r.hashed = hit  # hit blocks carry their hash already
        self._hash_full(r, computed + n, loaded_upto=hit + ext)
        return n

    def _take_hits(self, r: Req, hit_blocks: list) -> bool:
        """When r's whole sequence fits (vLLM's scheduler_reserve_full_isl), take its hit blocks
        (out of the free queue when idle) and say True; else change nothing and say False."""
        ref, free, hit = self.ref, self.free, len(hit_blocks)
        if r.distinct:
            hb = _ints(hit_blocks)
            idle = ref[hb] == 0
            evictable = int(idle.sum())
            if -(-r.num_tokens // self.B) - hit + evictable > len(free):
                return False
            if evictable:
                free.remove(hb[idle])
            ref[hb] += 1
            return True
        evictable = sum(1 for b in hit_blocks if not ref[b])
        if -(-r.num_tokens // self.B) - hit + evictable > len(free):
            return False
        for b in hit_blocks:
            if not ref[b]:
                free.remove([b])
            ref[b] += 1
        return True

    def _start(self) -> tuple[list, list, dict]:
        """Fresh replay state per request; the heap of (arrival, index) of the open-loop ones; and
        index -> the closed-loop requests its finish sends."""
        wl, B, m = self.wl, self.B, self.m
        reqs = [Req(r.rid, r.arrival, r.prompt_len, r.output, r.chain, -1 if self.clock else r.after, r.gap, r.rank)
                for r in wl.reqs]
        # ranks 0..n-1: the recorded order of first admissions; requests without one after, by arrival
        for rank, i in enumerate(sorted(range(len(reqs)), key=lambda i: (reqs[i].rank < 0, reqs[i].rank,
                                                                          reqs[i].arrival, i))):
            reqs[i].rank = rank
        distinct = wl.distinct()  # a chain without a repeated hash has none in any slice
        for r in reqs:
            r.keys = r.chain[m - 1::m][: r.prompt_len // B]
            r.distinct = distinct[id(r.chain)]
            r.num_tokens = r.prompt_len
        pending = sorted((r.arrival, i) for i, r in enumerate(reqs) if r.after < 0)
        heapq.heapify(pending)
        triggered: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.after >= 0:
                triggered.setdefault(r.after, []).append(i)
        return reqs, pending, triggered

    def run(self) -> dict:
        reqs, pending, triggered = self._start()
        waiting = Waiting(ordered=self.clock is not None)
        running: list = []
        now = pending[0][0] if pending else 0
        done = 0
        t_start = now
        while done < len(reqs):
            self._arrive(pending, reqs, waiting, now)
            if not waiting and not running:
                if not pending:
                    if waiting.blocked():
                        waiting.unblock()
                        continue
                    break  # a closed-loop request whose trigger never finished
                now = pending[0][0]
                continue
            sched, budget, preempted = self._schedule_running(running, waiting)
            if not preempted:
                self._admit_waiting(waiting, running, sched, budget)
            if not sched:
                # nothing fits (a request larger than the cache): drop it, as vLLM would reject it
                if waiting and not running:
                    done += self._drop_unservable(waiting, now)
                    continue
                now = pending[0][0] if pending else now + 1_000_000
                continue
            now = self._step(sched, now)
            done += self._finish(sched, running, reqs, triggered, pending, now)
        return self._summary(reqs, now - t_start)

    @staticmethod
    def _arrive(pending: list, reqs: list, waiting: Waiting, now: int) -> None:
        """Move the requests due by now from the heap into the waiting queue."""
        while pending and pending[0][0] <= now:
            t_arr, i = heapq.heappop(pending)
            reqs[i].arrived_ns = t_arr   # a closed-loop request: when its trigger's replayed finish sent it
            waiting.append(reqs[i])

    def _drop_unservable(self, waiting: deque, now: int) -> int:
        """The head request fits nowhere (larger than the cache): dropped, as the engine rejects it."""
        waiting.popleft().done_ns = now
        self.stats["unservable"] = self.stats.get("unservable", 0) + 1
        return 1

    def _schedule_running(self, running: list, waiting: deque) -> tuple[list, int, bool]:
        """Running requests first, each its next chunk or token within the budget; an allocation
        that fails preempts the last running request.  (scheduled, budget left, preempted)"""
        B = self.B
        budget = self.C
        sched: list = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.computed, budget)
            need = -(-(r.computed + n) // B)
            while need - len(r.blocks) > len(self.free):
                victim = running.pop()
                self._preempt(victim, waiting)
                preempted = True
                if victim is r:
                    return sched, budget, preempted
            self._alloc(r, need)
            self._hash_full(r, r.computed + n)
            sched.append((r, n))
            budget -= n
            i += 1
        return sched, budget, preempted

    def _admit_waiting(self, waiting: deque, running: list, sched: list, budget: int) -> None:
        """Admit from the waiting queue (FCFS) while the budget and max_num_seqs allow and the head fits."""
        while budget > 0 and waiting and len(running) < self.max_seqs:
            r = waiting[0]
            n = self._admit(r, budget, bool(running))
            if not n:
                break
            waiting.popleft()
            running.append(r)
            sched.append((r, n))
            budget -= n

    def _step(self, sched: list, now: int) -> int:
        """The step's end: a + b·prefill tokens + c·decode requests after now."""
        a, b, c = self.wl.model
        kinds = [r.generated == 0 or r.num_tokens - r.computed > 1 for r, _ in sched]
        prefill = sum(n for (r, n), pf in zip(sched, kinds) if pf)
        decode = len(sched) - sum(kinds)
        k = self.stats["steps"]
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += prefill
        wait, self.wait_ns = self.wait_ns, 0.0
        self.stats["storage_wait_ns"] = self.stats.get("storage_wait_ns", 0) + int(wait)
        if self.clock is not None and k < len(self.clock):
            return now + self.clock[k]   # the recording's step k (its loads' wait included)
        return now + int(a + b * prefill + c * decode + wait)

    def _finish(self, sched: list, running: list, reqs: list, triggered: dict, pending: list, now: int) -> int:
        """Account the step's tokens; free the requests it finished and send the closed-loop
        requests waiting for them.  How many finished."""
        finished = []
        for r, n in sched:
            r.computed += n
            self._computed(r)
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
            for j in triggered.get(self._index(reqs, r), []):
                heapq.heappush(pending, (now + reqs[j].gap, j))
        return len(finished)

    def _computed(self, r: Req) -> None:
        """r's computed tokens just advanced (a cache that holds partial blocks takes them here)."""

    def _summary(self, reqs: list, replayed_ns: int) -> dict:
        s = dict(self.stats)
        s["hit_rate"] = (s["hit_local"] + s["hit_external"]) / s["prompt_tokens"] if s["prompt_tokens"] else None
        s["replayed_ns"] = replayed_ns
        ttft = sorted(r.first_token_ns - r.arrived_ns for r in reqs if r.first_token_ns)
        s["ttft_p50_ns"] = ttft[(len(ttft) + 1) // 2 - 1] if ttft else None
        s["ttft_p90_ns"] = ttft[max(-(-len(ttft) * 9 // 10) - 1, 0)] if ttft else None
        out = sum(r.generated for r in reqs)
        s["output_tokens"] = out
        s["output_tokens_per_s"] = out / (replayed_ns / 1e9) if replayed_ns else None
        s["storage_wait_ns"] = s.get("storage_wait_ns", 0)
        loaded = s["storage_loads"] * self.m * self.wl.storage.block_bytes
        s["storage_read_gb_per_s"] = loaded / replayed_ns if replayed_ns and loaded else 0.0
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
