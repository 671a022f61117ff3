"""SGLang's scheduler (0.5.23, no overlap scheduling, no mixed chunks, FCFS) over its radix cache
(radixtree.RadixTree), as the replay's cache model:

* Prefix match at admission: the longest cached path, at most the pages below the request's
  length - 1 (SGLang computes at least one token), split and touched as SGLang's match_prefix
  does.
* A step is a prefill batch or a decode batch, never both.  A prefill pass (SGLang's
  get_new_batch_prefill) first touches the waiting requests' cached prefixes every 32nd pass
  that has a request waiting (SGLang's waiting-prefix refresh, the queue's head last), counted
  from its count at the attach (estimated: passes_before); then takes the chunked request's next
  chunk, then waiting requests in queue order while the chunk budget (--chunked-prefill-size)
  lasts and each one's remaining input, its output and a page fit strictly in the free and
  evictable slots less the running requests' remaining output times SGLang's new_token_ratio
  (the recorded ``sglang:new_token_ratio``; 1 when not scraped) and what the batch admitted
  already.  An admission that does not fit stops admissions until a running request leaves
  (SGLang's batch_is_full).  The batch's slots are allocated after it is formed, so its
  admissions' hits are locked before anything is evicted for it.
* A computed chunk is inserted into the tree (deduplicated against pages another request
  inserted meanwhile); output tokens are inserted when the request finishes.
* A decode batch gives every running request a token; a token that does not fit retracts the
  running request with the fewest output tokens (its output freed, not inserted) back to the
  front of the queue; the last one left is aborted.
"""
from __future__ import annotations

import pyarrow as pa

from kvtrace.analysis.whatif.radixtree import RadixTree
from kvtrace.errors import UsageError

REFRESH_EVERY = 32   # SGLang's WAITING_PREFIX_REFRESH_INTERVAL (schedule_policy.py)
REFRESH_MAX = 128    # its WAITING_QUEUE_PREFIX_MATCH_MAX
# The passes SGLang counted before the recording: a server just started has made two (its
# warm-up request's and the first /health check's), or more (each /health check that generates
# counts one); the hook does not record the count, so passes_before estimates it.
PASSES_BEFORE = 2


class RadixCache(RadixTree):
    name = "radix"
    finish_lag = 0      # the hook sends a finish at the end of the step that finished the request
    free_seen = "most free slots seen"
    about = ("SGLang: its radix cache replayed (kvtrace.analysis.whatif.radix): block = page ({block_size} token), "
             "cache blocks = --max-total-tokens / page size")

    def __init__(self, drv, tier: str = "none", *, passes: int | None = None):
        if tier != "none":
            raise UsageError(f"--storage-tier {tier}: the SGLang replay models the device radix cache only (give none)")
        if drv.N < 1:
            raise UsageError(f"--cache-blocks {drv.N}: at least 1 (SGLang's --max-total-tokens / page size)")
        if drv.B % drv.wl.block_size:
            raise UsageError(f"--block-size {drv.B}: must be a multiple of the recorded page size {drv.wl.block_size}")
        super().__init__(drv)
        self.full = False           # an admission failed for memory: none tried until a request leaves
        # prefill passes with a request waiting (SGLang's refresh counter), from its count at the attach
        self.calls = passes_before(drv) if passes is None else passes
        ratio = drv.wl.recorded.get("new_token_ratio")
        self.ratio = 1.0 if ratio is None else ratio   # (unknown: all of the remaining output)
        self.need = 0               # slots the prefill batch being formed needs
        self.offset = 0.0           # slots reserved against its admissions

    @classmethod
    def capacity(cls, samples: pa.Table, prefix: str) -> tuple[int | None, str]:
        """The largest max_total_num_tokens sample."""
        series = prefix + "max_total_num_tokens"
        vals = [v for n, v in _samples(samples) if n == series]
        return (int(max(vals)) if vals else None), series

    @classmethod
    def new_token_ratio(cls, samples: pa.Table, prefix: str) -> float | None:
        """SGLang's estimate of the share of max_new_tokens a running request will still decode,
        which admission reserves: the median of the scraped gauge."""
        series = prefix + "new_token_ratio"
        vals = sorted(v for n, v in _samples(samples) if n == series and v is not None)
        return float(vals[len(vals) // 2]) if vals else None

    # -- the scheduler's rules ----------------------------------------------------------------

    def continuing(self, drv) -> int:
        """A prefill pass: its waiting-prefix refresh, then the chunked request's next chunk (when
        it fits); the budget left for admissions (0: none in this pass)."""
        running, batch, budget = drv.running, drv.batch, drv.C
        if not running:
            self.full = False
        queued = drv.waiting.queued()
        if self.chunked is None and (self.full or not queued):
            return 0
        if queued:   # (SGLang counts the calls with a request waiting)
            if self.calls % REFRESH_EVERY == 0:   # the first included; the queue's head touched last
                for r in reversed(queued[:REFRESH_MAX]):
                    self.touch_prefix(r)
            self.calls += 1
        # the batch is formed first (each admission's match locks its prefix), its slots taken
        # after, at once (SGLang's PrefillAdder, then prepare_for_extend's allocation)
        c, self.need = self.chunked, 0
        self.offset = sum(max(x.output - x.generated, 0) * self.ratio for x in running if x is not c)
        if c is not None:
            n = min(c.num_tokens - c.computed, budget)
            k = self.pages(c, c.computed + n)
            if k <= self.free_capacity():
                batch.append((c, n))
                self.need += k
                self.offset += c.num_tokens - c.computed + max(c.output - c.generated, 0) + self.B
                budget -= n
                self.chunked = None if c.computed + n >= c.num_tokens else c
        return budget if self.chunked is None and not self.full else 0

    def admit(self, drv, r, budget: int) -> tuple[int, int] | None:
        """SGLang's PrefillAdder: r's remaining input and output and a page must fit (strictly) in
        the free and evictable slots less what the running requests are expected to decode
        (their remaining output x new_token_ratio) and what this batch admitted already."""
        hit = self.match(r)
        rest = r.num_tokens - hit * self.B
        total = rest + max(r.output - r.generated, 0) + self.B
        if total + self.offset >= self.free_capacity():
            self.free(r)
            # SGLang's batch_is_full: no admission is tried again (no match) until a running
            # request leaves
            self.full = bool(drv.batch or drv.running)
            return None
        n = min(rest, budget)
        r.computed = hit * self.B
        self.need += self.pages(r, r.computed + n)
        self.offset += total
        if r.computed + n < r.num_tokens:
            self.chunked = r
        return hit, 0

    def formed(self, drv) -> None:
        """A prefill batch gets its slots, at once; without one, a decode batch."""
        if drv.batch:
            self.room(self.need)
            for r, n in drv.batch:
                k = self.pages(r, r.computed + n)
                self.used += k
                r.priv += k
        elif drv.running:
            self._decode(drv)

    def _decode(self, drv) -> None:
        """A token for each running request; retract while they do not fit (the last one left,
        SGLang aborts)."""
        running = drv.running
        while running:
            if self.room(sum(self.pages(r, r.computed + 1) for r in running)):
                break
            victim = min(running, key=lambda r: (r.generated, -r.prompt_len))
            running.remove(victim)
            if not running:
                self.free(victim)
                drv.drop(victim)
                return
            self.full = False
            drv.requeue(victim)
        drv.batch.extend((r, 1) for r in running if self.alloc(r, r.computed + 1))

    def computed(self, r) -> None:
        """The chunk's tokens (or a decode's, until the first output) go into the tree."""
        if r.computed <= r.prompt_len or r.generated == 0:
            self.insert(r, min(r.computed, r.num_tokens))

    def finished(self, r) -> None:
        """Its output into the tree, its path unlocked."""
        self.full = False
        self.insert(r, r.computed)
        self.free(r)


def _samples(samples: pa.Table):
    """(name, value) of each sample."""
    if not samples.num_rows:
        return []
    return zip(samples.column("name").to_pylist(), samples.column("value").to_pylist())


def passes_before(drv) -> int:
    """SGLang's count of prefill passes at the attach, which decides on which passes its
    waiting-prefix refresh falls: the count (modulo REFRESH_EVERY) under which the replay at the
    recorded setting gives the most requests their recorded first-admission hit, PASSES_BEFORE
    and the counts nearest it first (the first that gives every request its hit ends the
    search); PASSES_BEFORE when the dataset cannot tell (no recorded setting to replay, or no
    count does better).  Computed once per workload."""
    wl = drv.wl
    if wl.passes_before is not None:
        return wl.passes_before
    rec, best, hits = wl.recorded, PASSES_BEFORE, wl.hits
    if wl.clock and hits and rec.get("chunk_size") and rec.get("cache_blocks"):
        order = sorted(range(REFRESH_EVERY), key=lambda p: (min((p - PASSES_BEFORE) % REFRESH_EVERY,
                                                                (PASSES_BEFORE - p) % REFRESH_EVERY), p))
        scores = {}
        for p in order:
            r = drv.recorded_replay(passes=p)
            r.run()
            scores[p] = sum(r.hits.get(rid) == h for rid, h in hits.items())
            if scores[p] == len(hits):
                break
        best = max(scores, key=lambda p: (scores[p], -order.index(p)))
    wl.passes_before = best
    return best
