"""`kvtrace whatif` on an SGLang dataset: a replay of SGLang's radix cache and scheduler (0.5.23,
no overlap scheduling, no mixed chunks, FCFS, LRU) over the recorded requests.

* Cache: ``--cache-blocks`` KV slots of ``--block-size`` tokens (SGLang's --max-total-tokens
  divided by its page size; the recorded page size is 1).  The radix tree's **nodes** are what
  SGLang inserts at once: a computed chunk, a finished request's output; each holds its pages,
  keyed by the hash of their last token's prefix (the hook's per-token chain).  A match or an
  insert that ends inside a node splits it there.  A running request locks the path from its
  node to the root; an allocation that does not fit in the free slots evicts unlocked **leaf
  nodes, whole, least recently used first** (a node's time is that of the last match, insert or
  touch that walked it; a parent becomes a leaf when its last child goes).
* Prefix match at admission: the longest cached path, at most the pages below the request's
  length - 1 (SGLang computes at least one token), split and touched as SGLang's match_prefix
  does.  Hits are counted at first admission.
* Steps: a step is a prefill batch or a decode batch, never both.  A prefill pass (SGLang's
  get_new_batch_prefill) first touches the waiting requests' cached prefixes every 32nd pass
  that has a request waiting (SGLang's waiting-prefix refresh, the queue's head last), counted
  from its count at the attach (estimated: passes_before); then takes the chunked request's next chunk, then waiting requests in
  queue order while the chunk budget (--chunked-prefill-size) lasts and each one's remaining
  input, its output and a page fit strictly in the free and evictable slots less the running
  requests' remaining output times SGLang's new_token_ratio (the recorded
  ``sglang:new_token_ratio``; 1 when not scraped) and what the batch admitted already.  An
  admission that does not fit stops admissions until a running request leaves (SGLang's
  batch_is_full).  The batch's slots are allocated after it is formed, so its admissions' hits
  are locked before anything is evicted for it.  A computed chunk is inserted into the tree
  (deduplicated against pages another request inserted meanwhile); output tokens are inserted
  when the request finishes.  A decode batch gives every running request a token; a token that
  does not fit retracts the running request with the fewest output tokens (its output freed,
  not inserted) back to the front of the queue.
* Step time, arrivals, the recorded setting and closed-loop clients: as for vLLM
  (kvtrace.analysis.whatif_replay).
"""
from __future__ import annotations

import heapq

from kvtrace.analysis.whatif_replay import Replay, Waiting
from kvtrace.analysis.whatif_workload import Req, Workload
from kvtrace.errors import UsageError

REFRESH_EVERY = 32   # SGLang's WAITING_PREFIX_REFRESH_INTERVAL (schedule_policy.py)
REFRESH_MAX = 128    # its WAITING_QUEUE_PREFIX_MATCH_MAX
# The passes SGLang counted before the recording: a server just started has made two (its
# warm-up request's and the first /health check's), or more (each /health check that generates
# counts one); the hook does not record the count, so passes_before estimates it.
PASSES_BEFORE = 2


def passes_before(wl: Workload) -> int:
    """SGLang's count of prefill passes at the attach, which decides on which passes its
    waiting-prefix refresh falls: the count (modulo REFRESH_EVERY) under which the replay at the
    recorded setting gives the most requests their recorded first-admission hit, PASSES_BEFORE
    and the counts nearest it first (the first that gives every request its hit ends the
    search); PASSES_BEFORE when the dataset cannot tell (no recorded setting to replay, or no
    count does better).  Computed once per workload."""
    known = getattr(wl, "passes_before", None)
    if known is not None:
        return known
    rec, best = wl.recorded, PASSES_BEFORE
    hits = getattr(wl, "hits", None) or {}
    if wl.clock and hits and rec.get("chunk_size") and rec.get("cache_blocks"):
        order = sorted(range(REFRESH_EVERY), key=lambda p: (min((p - PASSES_BEFORE) % REFRESH_EVERY,
                                                                (PASSES_BEFORE - p) % REFRESH_EVERY), p))
        scores = {}
        for p in order:
            r = RadixReplay(wl, rec["chunk_size"], wl.block_size, rec["cache_blocks"], passes=p)
            r.run()
            scores[p] = sum(r.hits.get(rid) == h for rid, h in hits.items())
            if scores[p] == len(hits):
                break
        best = max(scores, key=lambda p: (scores[p], -order.index(p)))
    wl.passes_before = best
    return best


class _Node:
    """A node of the radix tree: a run of pages inserted at once (a chunk, a request's output),
    or the part of one that a match or an insert split off."""

    __slots__ = ("keys", "depth", "parent", "children", "lock", "time", "alive")

    def __init__(self, keys: list, depth: int, parent, time: int):
        self.keys = keys            # its pages' keys (each the hash of its prefix)
        self.depth = depth          # pages above its first one
        self.parent = parent
        self.children: dict = {}    # a child's first key -> the child
        self.lock = 0               # running requests whose path holds it
        self.time = time            # its last match or insert
        self.alive = True


class RadixReplay(Replay):
    def __init__(self, wl: Workload, chunk: int, block: int, cache_blocks: int, tier: str = "none",
                 max_num_seqs: int = 256, *, passes: int | None = None):
        if tier != "none":
            raise UsageError(f"--storage-tier {tier}: the SGLang replay models the device radix cache only (give none)")
        if cache_blocks < 1:
            raise UsageError(f"--cache-blocks {cache_blocks}: at least 1 (SGLang's --max-total-tokens / page size)")
        if block % wl.block_size:
            raise UsageError(f"--block-size {block}: must be a multiple of the recorded page size {wl.block_size}")
        super().__init__(wl, chunk, block, 2, tier, max_num_seqs)
        self.N = cache_blocks
        self.clock = self._recorded_clock(chunk, block, cache_blocks, tier)
        self.root = _Node([], 0, None, 0)
        self.at: dict = {}          # page key -> the node holding it
        self.heap: list = []        # (time, seq, node): eviction candidates, checked when popped
        self.used = 0               # slots held: tree pages plus running requests' private ones
        self.locked = 0             # tree pages some running request holds
        self.tick = self.seq = 0
        self.full = False           # an admission failed for memory: none tried until a request leaves
        # prefill passes with a request waiting (SGLang's refresh counter), from its count at the attach
        self.calls = passes_before(wl) if passes is None else passes
        self.hits: dict = {}        # request -> pages hit at its first admission
        ratio = wl.recorded.get("new_token_ratio")
        self.ratio = 1.0 if ratio is None else ratio   # (unknown: all of the remaining output)

    # -- the tree ----------------------------------------------------------------------------

    def _push(self, n: _Node) -> None:
        """n became an unlocked leaf: a candidate for eviction at its time."""
        self.seq += 1
        heapq.heappush(self.heap, (n.time, self.seq, n))

    def _lock(self, n: _Node, d: int) -> None:
        """Lock (d = 1) or unlock (d = -1) the path from n up to the root, as SGLang's
        inc_lock_ref / dec_lock_ref do."""
        root = self.root
        while n is not root:
            if d > 0:
                if not n.lock:
                    self.locked += len(n.keys)
                n.lock += 1
            else:
                n.lock -= 1
                if not n.lock:
                    self.locked -= len(n.keys)
                    if not n.children:
                        self._push(n)
            n = n.parent

    def _touch(self, n: _Node, t: int) -> None:
        """The access time of every node from n up to the root (a match or an insert walks them)."""
        root = self.root
        while n is not root:
            n.time = t
            n = n.parent

    def _split(self, n: _Node, o: int) -> _Node:
        """Split n after its first o pages (a match or an insert ending inside it); the upper part."""
        up = _Node(n.keys[:o], n.depth, n.parent, n.time)
        up.lock = n.lock
        up.children[n.keys[o]] = n
        n.parent.children[n.keys[0]] = up
        at = self.at
        for k in up.keys:
            at[k] = up
        n.keys = n.keys[o:]
        n.depth += o
        n.parent = up
        return up

    def _evict(self, k: int) -> int:
        """Evict unlocked leaves, least recently used first, each whole, until k pages went; how many went."""
        at, root, gone = self.at, self.root, 0
        while gone < k and self.heap:
            t, _, n = heapq.heappop(self.heap)
            if not n.alive or n.lock or n.children or n.time != t:
                continue
            n.alive = False
            for key in n.keys:
                del at[key]
            gone += len(n.keys)
            p = n.parent
            del p.children[n.keys[0]]
            if p is not root and not p.children and not p.lock:
                self._push(p)
        self.used -= gone
        self.stats["evictions"] += gone
        return gone

    def _room(self, k: int) -> bool:
        """Make k free slots, evicting; False (nothing evicted beyond need) when they cannot be had."""
        short = k - (self.N - self.used)
        return short <= 0 or self._evict(short) >= short

    def _match(self, r: Req) -> int:
        """Pages of r's prefix in the tree (at most those below its length - 1): the node the
        match ends in is split there, the path touched and locked (SGLang's match_prefix)."""
        at, cap = self.at, (r.num_tokens - 1) // self.B
        keys = r.keys
        lim = min(cap, len(keys))
        m = 0
        while m < lim and keys[m] in at:   # the tree holds prefixes whole: present up to the first miss
            m += 1
        self.stats["lookups"] += m + (1 if m < lim else 0)
        self.tick += 1
        n = self.root
        if m:
            n = at[keys[m - 1]]
            if m - n.depth < len(n.keys):
                n = self._split(n, m - n.depth)
            self._touch(n, self.tick)
            self._lock(n, 1)
        r.node, r.held = n, m
        return m

    def _touch_prefix(self, r: Req) -> None:
        """SGLang's touch_prefix of a waiting request: its cached prefix (its whole sequence, not
        capped) split where it ends and touched, not locked."""
        at, keys = self.at, r.keys
        m = 0
        while m < len(keys) and keys[m] in at:
            m += 1
        if m:
            self.tick += 1
            n = at[keys[m - 1]]
            if m - n.depth < len(n.keys):
                n = self._split(n, m - n.depth)
            self._touch(n, self.tick)
            if not n.lock and not n.children:
                self._push(n)

    def _insert(self, r: Req, upto: int) -> None:
        """r's computed pages below token ``upto`` into the tree, as one new node (SGLang's
        insert of a chunk; at finish, of its output): its private slots become tree pages, or are
        freed where another request inserted the pages first; its lock moves to the new end."""
        end, start, keys, at = upto // self.B, r.held, r.keys, self.at
        if end <= start:
            return
        for j in range(len(keys), end):
            keys.append(("o", id(r), j))
        self.tick += 1
        t, j, old = self.tick, start, r.node
        while j < end and keys[j] in at:   # pages another request inserted meanwhile
            j += 1
        n = old
        if j > start:
            n = at[keys[j - 1]]
            if j - n.depth < len(n.keys):
                n = self._split(n, j - n.depth)
            self.used -= j - start          # a duplicate: SGLang frees its slot
        if j < end:
            leaf = _Node(keys[j:end], j, n, t)
            n.children[keys[j]] = leaf
            ever, B = self.ever, self.B
            for k in leaf.keys:
                at[k] = leaf
                if k in ever:
                    self.stats["recomputed_tokens"] += B
                else:
                    ever.add(k)
            n = leaf
        r.priv -= end - start
        self._touch(n, t)
        self._lock(n, 1)
        self._lock(old, -1)
        r.node, r.held = n, end

    def _release(self, r: Req) -> None:
        """Unlock r's path (its leaves become evictable) and free its private slots."""
        self._lock(r.node, -1)
        self.used -= r.priv
        r.priv = 0
        r.node, r.held = self.root, 0

    def _alloc_tokens(self, r: Req, n: int) -> bool:
        """Slots for r's next n tokens (pages it starts); False when they cannot be had."""
        need = -(-(r.computed + n) // self.B) - r.held - r.priv
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
            r.priv, r.node, r.held = 0, self.root, 0
        waiting = Waiting(ordered=self.clock is not None)
        running: list = []
        chunked = None
        now = t_start = pending[0][0] if pending else 0
        done = 0
        while done < len(reqs):
            self._arrive(pending, reqs, waiting, now)
            if not waiting and not running and chunked is None:
                if not pending:
                    if waiting.blocked():
                        waiting.unblock()
                        continue
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

    def _prefill(self, waiting: Waiting, running: list, chunked):
        """A prefill batch: the chunked request's next chunk, then admissions. (scheduled, the
        request left chunked)"""
        budget, sched = self.C, []
        if not running:
            self.full = False
        if chunked is None and (self.full or not waiting.queued()):
            return sched, None
        # SGLang's calc_priority: every REFRESH_EVERY-th call (the first included) touches the
        # waiting requests' cached prefixes, the queue's head last (the most recently used)
        queued = waiting.queued()
        if queued:   # (SGLang counts the calls with a request waiting)
            if self.calls % REFRESH_EVERY == 0:
                for r in reversed(queued[:REFRESH_MAX]):
                    self._touch_prefix(r)
            self.calls += 1
        # the batch is formed first (each admission's match locks its prefix), its slots taken
        # after, at once (SGLang's PrefillAdder, then prepare_for_extend's allocation)
        need = 0
        ratio = self.ratio
        offset = sum(max(x.output - x.generated, 0) * ratio for x in running if x is not chunked)
        if chunked is not None:
            n = min(chunked.num_tokens - chunked.computed, budget)
            k = self._pages(chunked, n)
            if k <= self._free_and_evictable():
                sched.append((chunked, n))
                need += k
                offset += chunked.num_tokens - chunked.computed + max(chunked.output - chunked.generated, 0) + self.B
                budget -= n
                chunked = None if chunked.computed + n >= chunked.num_tokens else chunked
        while budget > 0 and chunked is None and waiting and len(running) < self.max_seqs and not self.full:
            r = waiting[0]
            hit = self._match(r)
            rest = r.num_tokens - hit * self.B
            # SGLang's PrefillAdder: the request's remaining input and output and a page must
            # fit (strictly) in the free and evictable slots less what the running requests are
            # expected to decode (their remaining output x new_token_ratio) and what this batch
            # admitted already
            total = rest + max(r.output - r.generated, 0) + self.B
            if total + offset >= self._free_and_evictable():
                self._release(r)
                # SGLang's batch_is_full: no admission is tried again (no match) until a
                # running request leaves
                self.full = bool(sched or running)
                break
            waiting.popleft()
            n = min(rest, budget)
            r.computed = hit * self.B
            need += self._pages(r, n)
            offset += total
            self._count_admission(r, hit)
            sched.append((r, n))
            running.append(r)
            budget -= n
            if r.computed + n < r.num_tokens:
                chunked = r
        if sched:
            self._room(need)
            for r, n in sched:
                k = self._pages(r, n)
                self.used += k
                r.priv += k
        return sched, chunked

    def _pages(self, r: Req, n: int) -> int:
        """The slots r's next n tokens need beyond those it holds."""
        return max(-(-(r.computed + n) // self.B) - r.held - r.priv, 0)

    def _free_and_evictable(self) -> int:
        return self.N - self.used + len(self.at) - self.locked

    def _count_admission(self, r: Req, hit: int) -> None:
        s = self.stats
        if r.attempt == 0 and not r.admitted:
            self.hits[r.rid] = hit
            s["requests"] += 1
            s["prompt_tokens"] += r.prompt_len
            s["hit_local"] += hit * self.B
        else:
            s["readmit_hits"] += hit * self.B
        r.admitted = True

    def _decode(self, running: list, waiting: Waiting) -> tuple[list, list]:
        """A decode batch: a token for each running request; retract while they do not fit (the
        last one left, SGLang aborts).  (scheduled, aborted)"""
        while running:
            need = sum(max(-(-(r.computed + 1) // self.B) - r.held - r.priv, 0) for r in running)
            if self._room(need):
                break
            victim = min(running, key=lambda r: (r.generated, -r.prompt_len))
            running.remove(victim)
            if not running:
                self._release(victim)
                self.stats["unservable"] = self.stats.get("unservable", 0) + 1
                return [], [victim]
            self._release(victim)
            self.full = False
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
        self.full = False
        self._insert(r, r.computed)
        self._release(r)
