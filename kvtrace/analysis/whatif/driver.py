"""The replay's driver: the clock, the arrivals, the waiting queue and its order, admission and
chunking, finishes and the figures, over the cache model of the recorded server kind
(models.model_for; the model also holds its scheduler's own rules: cache.CacheModel).

A step: the model continues the running requests (``continuing``), then the driver admits from
the waiting queue, in its order, while the chunk budget and ``max_num_seqs`` allow and the model
admits the head (each admission's chunk the rest of its prompt within the budget; a chunked
prefill takes the rest of the step); then the model completes the batch (``formed``).  The step
lasts ``a + b·prefill tokens + c·decode requests`` (fitted: recorded.fit_steps) plus what its
admissions waited for the storage tier.

The clock and the order (docs/analysis.md, "The replay's order"): at the recorded setting
(chunk budget, block size, cache size and storage tier as recorded) every request arrives at its
recorded time, the replay's k-th step lasts as long as the recording's k-th step
(recorded.clock) and first admissions keep the recorded order, so the replay gives the
recorded run back; at any other setting the fitted step model times the steps, a request sent
within 100 ms of another's finish is re-timed to the same interval after that request's replayed
finish (a closed-loop client) and the queue is in the replay's own arrival order.
"""
from __future__ import annotations

import heapq

from kvtrace.analysis.whatif.models import model_for
from kvtrace.analysis.whatif.waiting import Waiting
from kvtrace.analysis.whatif.workload import Req, Workload


class Replay:
    def __init__(self, wl: Workload, chunk: int, block: int, cache_blocks: int, tier: str = "none",
                 max_num_seqs: int = 256, **options):
        """``options`` go to the cache model (RadixCache's ``passes``)."""
        self.wl, self.C, self.B, self.N = wl, chunk, block, cache_blocks
        self.max_seqs = max_num_seqs
        self.stats = dict(requests=0, prompt_tokens=0, hit_local=0, hit_external=0, evictions=0, storage_loads=0,
                          preemptions=0, prefill_tokens=0, recomputed_tokens=0, readmit_hits=0, steps=0, lookups=0)
        self.hits: dict = {}          # request -> pages hit at its first admission
        self.wait_ns = 0.0            # what the step's admissions wait for the storage tier
        self.model = model_for(wl.kind, wl.groups)(self, tier, **options)   # refuses settings it cannot replay
        self.m = block // wl.block_size
        rec = wl.recorded
        same = (chunk, block, cache_blocks, tier) == (rec.get("chunk_size"), wl.block_size, rec.get("cache_blocks"),
                                                      rec.get("storage_tier", "none"))
        self.clock = wl.clock if same and wl.clock else None   # the recorded steps' times, at the recorded setting
        self.waiting = Waiting(ordered=self.clock is not None)
        self.running: list = []
        self.batch: list = []         # the step's (request, tokens)
        self.now = self.done = 0

    def recorded_replay(self, **options) -> Replay:
        """A replay of the same workload at the recorded setting (a model estimating what the
        recording does not say runs these)."""
        rec = self.wl.recorded
        return Replay(self.wl, rec["chunk_size"], self.wl.block_size, rec["cache_blocks"], **options)

    def run(self) -> dict:
        """Replay every request, once; the predicted figures."""
        reqs, pending, triggered = self._start()
        waiting, running, model = self.waiting, self.running, self.model
        self.now = t_start = pending[0][0] if pending else 0
        while self.done < len(reqs):
            self._arrive(pending, reqs)
            if not waiting and not running and model.chunked is None:
                if not pending:
                    if waiting.blocked():
                        waiting.unblock()
                        continue
                    break  # a closed-loop request whose trigger never finished
                self.now = pending[0][0]
                continue
            self.batch = []
            budget = model.continuing(self)
            self._admit(budget)
            model.formed(self)
            if not self.batch:
                # nothing fits (a request larger than the cache): drop it, as the engine would reject it
                if waiting and not running and model.chunked is None:
                    self.drop(waiting.popleft())
                    continue
                self.now = pending[0][0] if pending else self.now + 1_000_000
                continue
            self.now = self._step()
            self.done += self._finish(reqs, triggered, pending)
        return self._summary(reqs, self.now - t_start)

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
        self.model.start(reqs)
        self._idx = {id(r): i for i, r in enumerate(reqs)}
        pending = sorted((r.arrival, i) for i, r in enumerate(reqs) if r.after < 0)
        heapq.heapify(pending)
        triggered: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.after >= 0:
                triggered.setdefault(r.after, []).append(i)
        return reqs, pending, triggered

    def _arrive(self, pending: list, reqs: list) -> None:
        """Move the requests due by now from the heap into the waiting queue."""
        while pending and pending[0][0] <= self.now:
            t_arr, i = heapq.heappop(pending)
            reqs[i].arrived_ns = t_arr   # a closed-loop request: when its trigger's replayed finish sent it
            self.waiting.append(reqs[i])

    def _admit(self, budget: int) -> None:
        """Admit from the waiting queue, in its order, while the budget and max_num_seqs allow and
        the model admits the head."""
        waiting, running, batch = self.waiting, self.running, self.batch
        while budget > 0 and waiting and len(running) < self.max_seqs:
            r = waiting[0]
            hit = self.model.admit(self, r, budget)
            if hit is None:
                break
            waiting.popleft()
            n = min(r.num_tokens - r.computed, budget)
            self._count_admission(r, *hit)
            running.append(r)
            batch.append((r, n))
            budget -= n
            if r.computed + n < r.num_tokens:
                break   # a chunked prefill: the step's budget is spent

    def _count_admission(self, r: Req, local: int, storage: int = 0) -> None:
        """Hits count at a request's first admission (the analysis counts them so)."""
        s, B = self.stats, self.B
        if r.attempt == 0 and not r.admitted:
            self.hits[r.rid] = local + storage
            s["requests"] += 1
            s["prompt_tokens"] += r.prompt_len
            s["hit_local"] += local * B
            s["hit_external"] += storage * B
        else:
            s["readmit_hits"] += (local + storage) * B
        r.admitted = True

    def requeue(self, r: Req) -> None:
        """r preempted (or retracted): its pages let go, back to the front of the queue to compute again."""
        self.model.free(r)
        r.computed = 0
        r.attempt += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(r)

    def drop(self, r: Req) -> None:
        """r fits nowhere (larger than the cache): it ends unserved, as the engine rejects it."""
        r.done_ns = self.now
        self.stats["unservable"] = self.stats.get("unservable", 0) + 1
        self.done += 1

    def _step(self) -> int:
        """The step's end: the recording's step at its place, or a + b·prefill tokens + c·decode
        requests and the storage wait after now."""
        a, b, c = self.wl.model
        kinds = [r.generated == 0 or r.num_tokens - r.computed > 1 for r, _ in self.batch]
        prefill = sum(n for (r, n), pf in zip(self.batch, kinds) if pf)
        decode = len(self.batch) - sum(kinds)
        k = self.stats["steps"]
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += prefill
        wait, self.wait_ns = self.wait_ns, 0.0
        self.stats["storage_wait_ns"] = self.stats.get("storage_wait_ns", 0) + int(wait)
        if self.clock is not None and k < len(self.clock):
            return self.now + self.clock[k]   # the recording's step k (its loads' wait included)
        return self.now + int(a + b * prefill + c * decode + wait)

    def _finish(self, reqs: list, triggered: dict, pending: list) -> int:
        """Account the step's tokens; free the requests it finished and send the closed-loop
        requests waiting for them.  How many finished."""
        now, finished = self.now, []
        for r, n in self.batch:
            r.computed += n
            self.model.computed(r)
            if r.computed >= r.num_tokens:
                r.generated += 1
                if r.generated == 1 and not r.first_token_ns:
                    r.first_token_ns = now
                if r.generated >= r.output:
                    finished.append(r)
                else:
                    r.num_tokens += 1
        for r in finished:
            self.running.remove(r)
            self.model.finished(r)
            r.done_ns = now
            for j in triggered.get(self._idx[id(r)], []):
                heapq.heappush(pending, (now + reqs[j].gap, j))
        return len(finished)

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
