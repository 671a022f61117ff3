"""`kvtrace whatif` on an SGLang dataset: a replay of SGLang's radix cache and scheduler (0.5.23,
no overlap scheduling, no mixed chunks) over the recorded requests.

* Cache: ``--cache-blocks`` KV slots of ``--block-size`` tokens (SGLang's --max-total-tokens
  divided by its page size; the recorded page size is 1).  The radix tree holds pages keyed by
  the hash of their last token's prefix (the hook's per-token chain), children under parents.
  A request's matched or inserted path is locked while it runs; an allocation that does not fit
  in the free slots evicts unlocked **leaves, least recently used first** (a node's time is that
  of its last match or insert; a parent becomes a leaf when its last child goes).
* Prefix match at admission: the longest cached path, at most the pages below the request's
  length - 1 (SGLang computes at least one token).  Hits are counted at first admission.
* Steps: a step is a prefill batch or a decode batch, never both.  Prefill first: the chunked
  request's next chunk, then waiting requests (FCFS) while the chunk budget
  (--chunked-prefill-size) lasts and the request's remaining prompt plus its remaining output
  fit in the free and evictable slots (SGLang reserves output tokens by an estimate; this
  replay reserves them all: the conservative admission).  A computed chunk is inserted into the
  tree (deduplicated against pages another request inserted meanwhile); output tokens are
  inserted when the request finishes.  A decode batch gives every running request a token; a
  token that does not fit retracts the running request with the fewest output tokens (its
  output freed, not inserted) back to the front of the queue.
* Step time, arrivals and closed-loop clients: as for vLLM (kvtrace.analysis.whatif_replay).
"""
from __future__ import annotations

import heapq
from collections import deque

from kvtrace.analysis.whatif_replay import Replay
from kvtrace.analysis.whatif_workload import Req, Workload
from kvtrace.errors import UsageError

PARENT, CHILDREN, LOCK, TIME = 0, 1, 2, 3


class RadixReplay(Replay):
    def __init__(self, wl: Workload, chunk: int, block: int, cache_blocks: int, tier: str = "none",
                 max_num_seqs: int = 256):
        if tier != "none":
            raise UsageError(f"--storage-tier {tier}: the SGLang replay models the device radix cache only (give none)")
        if cache_blocks < 1:
            raise UsageError(f"--cache-blocks {cache_blocks}: at least 1 (SGLang's --max-total-tokens / page size)")
        if block % wl.block_size:
            raise UsageError(f"--block-size {block}: must be a multiple of the recorded page size {wl.block_size}")
        super().__init__(wl, chunk, block, 2, tier, max_num_seqs)
        self.N = cache_blocks
        self.nodes: dict = {}       # key -> [parent key, children, lock count, last access]
        self.heap: list = []        # (last access, seq, key): eviction candidates, checked when popped
        self.used = 0               # slots held: tree pages plus running requests' private ones
        self.locked = 0             # tree pages some running request holds
        self.tick = self.seq = 0

    # -- the tree ----------------------------------------------------------------------------

    def _push(self, key) -> None:
        n = self.nodes[key]
        if n[LOCK] == 0 and n[CHILDREN] == 0:
            self.seq += 1
            heapq.heappush(self.heap, (n[TIME], self.seq, key))

    def _evict(self, k: int) -> int:
        """Evict up to k unlocked leaves, least recently used first; how many went."""
        nodes, gone = self.nodes, 0
        while gone < k and self.heap:
            t, _, key = heapq.heappop(self.heap)
            n = nodes.get(key)
            if n is None or n[LOCK] or n[CHILDREN] or n[TIME] != t:
                continue
            del nodes[key]
            gone += 1
            p = n[PARENT]
            if p is not None and p in nodes:
                nodes[p][CHILDREN] -= 1
                self._push(p)
        self.used -= gone
        self.stats["evictions"] += gone
        return gone

    def _room(self, k: int) -> bool:
        """Make k free slots, evicting; False (nothing evicted beyond need) when they cannot be had."""
        short = k - (self.N - self.used)
        return short <= 0 or self._evict(short) >= short

    def _match(self, r: Req) -> int:
        """Pages of r's prefix in the tree (at most those below its length - 1), touched and locked."""
        nodes, cap = self.nodes, (r.num_tokens - 1) // self.B
        self.tick += 1
        path = []
        for key in r.keys[:cap]:
            n = nodes.get(key)
            if n is None:
                break
            path.append(key)
        self.stats["lookups"] += len(path) + (1 if len(path) < min(cap, len(r.keys)) else 0)
        for key in path:
            n = nodes[key]
            self.locked += n[LOCK] == 0
            n[LOCK] += 1
            n[TIME] = self.tick
        r.blocks = path
        return len(path)

    def _insert(self, r: Req, upto: int) -> None:
        """r's computed pages below token ``upto`` into the tree: its private slots become pages
        (or are freed where another request inserted the page first), locked by r."""
        nodes, B = self.nodes, self.B
        self.tick += 1
        parent = r.blocks[-1] if r.blocks else None
        for j in range(len(r.blocks), upto // B):
            if j >= len(r.keys):
                r.keys.append(("o", id(r), j))
            key = r.keys[j]
            n = nodes.get(key)
            if n is None:
                nodes[key] = n = [parent, 0, 0, self.tick]
                if parent is not None:
                    nodes[parent][CHILDREN] += 1
                if key in self.ever:
                    self.stats["recomputed_tokens"] += B
                else:
                    self.ever.add(key)
            else:
                self.used -= 1   # a duplicate: SGLang frees its slot
            self.locked += n[LOCK] == 0
            n[LOCK] += 1
            n[TIME] = self.tick
            r.priv -= 1
            r.blocks.append(key)
            parent = key

    def _release(self, r: Req) -> None:
        """Unlock r's path (its leaves become evictable) and free its private slots."""
        nodes = self.nodes
        for key in r.blocks:
            n = nodes[key]
            n[LOCK] -= 1
            self.locked -= n[LOCK] == 0
        for key in reversed(r.blocks):
            self._push(key)
        self.used -= r.priv
        r.priv = 0
        r.blocks = []

    def _alloc_tokens(self, r: Req, n: int) -> bool:
        """Slots for r's next n tokens (pages it starts); False when they cannot be had."""
        need = -(-(r.computed + n) // self.B) - len(r.blocks) - r.priv
        if need > 0:
            if not self._room(need):
                return False
            self.used += need
            r.priv += need
        return True

    # -- the scheduler ------------------------------------------------------------------------

    def run(self) -> dict:
        reqs, pending, triggered = self._start()
        for r in reqs:
            r.priv = 0
        waiting: deque = deque()
        running: list = []
        chunked = None
        now = t_start = pending[0][0] if pending else 0
        done = 0
        while done < len(reqs):
            self._arrive(pending, reqs, waiting, now)
            if not waiting and not running and chunked is None:
                if not pending:
                    break
                now = pending[0][0]
                continue
            sched, chunked = self._prefill(waiting, running, chunked)
            if not sched and running:
                sched, aborted = self._decode(running, waiting)
                for r in aborted:
                    r.done_ns = now
                done += len(aborted)
            if not sched:
                if waiting and not running and chunked is None:
                    done += self._drop_unservable(waiting, now)
                    continue
                now = pending[0][0] if pending else now + 1_000_000
                continue
            now = self._step(sched, now)
            done += self._finish(sched, running, reqs, triggered, pending, now)
        return self._summary(reqs, now - t_start)

    def _prefill(self, waiting: deque, running: list, chunked):
        """A prefill batch: the chunked request's next chunk, then admissions. (scheduled, the
        request left chunked)"""
        budget, sched = self.C, []
        if chunked is not None:
            n = min(chunked.num_tokens - chunked.computed, budget)
            if self._alloc_tokens(chunked, n):
                sched.append((chunked, n))
                budget -= n
                chunked = None if chunked.computed + n >= chunked.num_tokens else chunked
        while budget > 0 and chunked is None and waiting and len(running) < self.max_seqs:
            r = waiting[0]
            hit = self._match(r)
            rest = r.num_tokens - hit * self.B
            reserve = sum(max(x.output - x.generated, 0) for x in running)
            if rest + max(r.output - r.generated, 0) + reserve > self._free_and_evictable() \
                    or not self._alloc_tokens_after_hit(r, hit, min(rest, budget)):
                self._release(r)
                break
            waiting.popleft()
            n = min(rest, budget)
            self._count_admission(r, hit)
            sched.append((r, n))
            running.append(r)
            budget -= n
            if r.computed + n < r.num_tokens:
                chunked = r
        return sched, chunked

    def _alloc_tokens_after_hit(self, r: Req, hit: int, n: int) -> bool:
        r.computed = hit * self.B
        return self._alloc_tokens(r, n)

    def _free_and_evictable(self) -> int:
        return self.N - self.used + len(self.nodes) - self.locked

    def _count_admission(self, r: Req, hit: int) -> None:
        s = self.stats
        if r.attempt == 0 and not r.admitted:
            s["requests"] += 1
            s["prompt_tokens"] += r.prompt_len
            s["hit_local"] += hit * self.B
        else:
            s["readmit_hits"] += hit * self.B
        r.admitted = True

    def _decode(self, running: list, waiting: deque) -> tuple[list, list]:
        """A decode batch: a token for each running request; retract while they do not fit (the
        last one left, SGLang aborts).  (scheduled, aborted)"""
        while running:
            need = sum(max(-(-(r.computed + 1) // self.B) - len(r.blocks) - r.priv, 0) for r in running)
            if self._room(need):
                break
            victim = min(running, key=lambda r: (r.generated, -r.prompt_len))
            running.remove(victim)
            if not running:
                self._release(victim)
                self.stats["unservable"] = self.stats.get("unservable", 0) + 1
                return [], [victim]
            self._release(victim)
            victim.computed = 0
            victim.attempt += 1
            self.stats["preemptions"] += 1
            waiting.appendleft(victim)
        sched = []
        for r in running:
            if self._alloc_tokens(r, 1):
                sched.append((r, 1))
        return sched, []

    def _computed(self, r: Req) -> None:
        """The chunk's tokens (or a decode's, until the first output) go into the tree."""
        if r.computed <= r.prompt_len or r.generated == 0:
            self._insert(r, min(r.computed, r.num_tokens))

    def _free(self, r: Req) -> None:
        """A finished request: its output into the tree, its path unlocked."""
        self._insert(r, r.computed)
        self._release(r)
