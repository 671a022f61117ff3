"""The replay's KV cache (kvtrace/analysis/whatif.py has the model it follows): vLLM's block pool
with its free-block queue, the prefix-cache index, and a storage tier (a KV connector's store).
``BlockPool.bytes_for`` says what a cache of N blocks costs before any of it is allocated."""
from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import compress, repeat

import numpy as np

from kvtrace.analysis.whatif_workload import Req
from kvtrace.errors import UsageError


def _ints(x) -> np.ndarray:
    """Block ids as an int64 array (np.fromiter: a list of Python ints converts faster than np.array)."""
    return x if isinstance(x, np.ndarray) else np.fromiter(x, np.int64, len(x))


class Tier:
    """A KV connector's store: every computed block is written; a prefix is loaded back at admission,
    at the tier's read speed (kvtrace.analysis.whatif_storage)."""

    def __init__(self, spec: str):
        self.name = spec
        self.on, self.cap, self.gbps, self.latency_us = parse_tier(spec)
        self.keys: OrderedDict = OrderedDict()

    def store(self, key) -> None:
        if not self.on or key in self.keys:
            return
        self.keys[key] = None
        if self.cap is not None and len(self.keys) > self.cap:
            self.keys.popitem(last=False)


TIER_HELP = ("give none, or file[:BLOCKS][@READ_GBPS[/LATENCY_US]] (e.g. file, file:4096, file@0.5, "
             "file:4096@2/100)")


def parse_tier(spec: str) -> tuple[bool, int | None, float | None, float | None]:
    """--storage-tier none | file[:BLOCKS][@READ_GBPS[/LATENCY_US]] -> (on, BLOCKS, GB/s, µs),
    None for what is not given; UsageError otherwise."""
    head, at, speed = spec.partition("@")
    kind, colon, cap = head.partition(":")
    if kind not in ("file", "none") or (kind == "none" and (colon or at)):
        raise UsageError(f"--storage-tier {spec!r}: {TIER_HELP}")
    blocks = gbps = lat = None
    if colon:
        try:
            blocks = int(cap.strip())
        except ValueError:
            blocks = None
        if blocks is None or blocks <= 0:
            raise UsageError(f"--storage-tier {spec!r}: BLOCKS must be a whole number above 0 (e.g. file:4096), "
                             "or give file for an unbounded store")
    if at:
        g, slash, lt = speed.partition("/")
        try:
            gbps = float(g)
            lat = float(lt) if slash else None
        except ValueError:
            gbps = None
        if gbps is None or not gbps > 0 or gbps == float("inf") or (lat is not None and not 0 <= lat < float("inf")):
            raise UsageError(f"--storage-tier {spec!r}: READ_GBPS must be a number above 0 and LATENCY_US one of "
                             f"at least 0 ({TIER_HELP})")
    return kind == "file", blocks, gbps, lat


class FreeQueue:
    """vLLM's free-block queue: pop from the front, put back at either end, take out from the
    middle (a hit on an idle cached block), all in order.  Kept as a numpy array of entries
    version * n + block with lazy removal: a block's entry is live while the block is free and
    the entry carries the block's current version (bumped each time the block is put back), so
    taking a request's blocks out or putting them back is a few array operations, not one Python
    step per block.  Dead entries are skipped at the front, and all dropped at once when they
    outnumber the live ones."""

    @staticmethod
    def bytes_for(n: int) -> int:
        """The most memory the queue of n blocks holds at once: ver (int64) and isfree (bool) per
        block, the entry buffer (``_place``: the live entries plus room for n + 4096 at each end,
        int64), and while ``_compact`` runs, ``_live``'s temporaries over each entry of that buffer
        (b, ver[b] and ver[b] * n as int64, isfree[b] as bool; more than the new buffer it then
        allocates beside the old)."""
        entries = 3 * n + 2 * 4096
        return 9 * n + 8 * entries + 25 * entries

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


class BlockPool:
    """vLLM's KV block pool for one replay: the free-block queue, each block's hash and reference
    count, and the prefix-cache index from hash to the blocks holding it."""

    def __init__(self, block: int, cache_blocks: int, tier: str = "none"):
        if cache_blocks < 2:
            raise UsageError(f"--cache-blocks {cache_blocks}: at least 2 (one is vLLM's null block)")
        self.B, self.N = block, cache_blocks
        self.tier = Tier(tier)
        n = cache_blocks - 1
        self.free = FreeQueue(n)
        self.bhash: list = [None] * n
        self.ref = np.zeros(n, dtype=np.int64)
        self.cached: dict = {}               # key -> [block ids holding it]
        self.head: dict = {}                 # key -> the first of them (the one a hit takes)
        self.ever: set = set()               # keys ever computed (recompute accounting)
        self.stats = dict(requests=0, prompt_tokens=0, hit_local=0, hit_external=0, evictions=0, storage_loads=0,
                          preemptions=0, prefill_tokens=0, recomputed_tokens=0, readmit_hits=0, steps=0, lookups=0)

    @staticmethod
    def bytes_for(cache_blocks: int) -> int:
        """The most memory the arrays of a pool of cache_blocks take (the null block has none):
        the free queue's, ``ref`` (int64) and ``bhash`` (a pointer) per block.  The index
        (cached, head, ever) and the tier grow with the workload's distinct hashes, not with it."""
        n = max(cache_blocks - 1, 0)
        return FreeQueue.bytes_for(n) + 8 * n + 8 * n

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

