"""vLLM's block pool (vLLM 0.32, v1 engine) as the replay's cache model, with its scheduler's rules:

* ``cache_blocks`` blocks, one of them vLLM's null block.  Free blocks form one queue
  (freequeue.FreeQueue); allocation pops its head, and a popped block that still holds a hash
  is an **eviction**.  A finished or preempted request frees its blocks tail first; blocks with
  a hash go to the back (LRU), blocks without one to the front.  Full blocks are hashed when
  allocated (so a request admitted later in the same step can hit them); output blocks get
  hashes no prompt shares.
* Admission (only in steps without a preemption): the longest cached prefix, at most
  ``(tokens - 1) // block`` blocks; then the storage tier's consecutive blocks (tier.Tier, or
  LMCache's chunks: lmcache.LmcacheTier);
  admitted only if the whole sequence fits (vLLM's ``scheduler_reserve_full_isl``).
* Steps: running requests first (prefill chunks, then 1 token per decode), each within the chunk
  budget; an allocation that fails preempts the last running request.  Admissions wait for the
  blocks they load from the tier (storage.StorageModel: the connector's recorded own work per
  block plus the read at the recorded speed or at ``@READ_GBPS[/LATENCY_US]``).
"""
from __future__ import annotations

import functools
import json
import operator
from itertools import compress, islice, repeat, takewhile

import numpy as np
import pyarrow as pa

from kvtrace.analysis.whatif.cache import CacheModel
from kvtrace.analysis.whatif.freequeue import FreeQueue, as_ints
from kvtrace.analysis.whatif.lmcache import LmcacheTier
from kvtrace.analysis.whatif.tier import Tier, parse_tier
from kvtrace.errors import UsageError

_not_none = functools.partial(operator.is_not, None)


class BlockPool(CacheModel):
    """The free-block queue, each block's hash and reference count, and the prefix-cache index
    from hash to the blocks holding it."""

    name = "block_pool"
    finish_lag = 1      # vLLM reports a request finished in the next step's output
    null_blocks = 1
    free_seen = "most free blocks seen + the null block"

    def __init__(self, drv, tier: str = "none"):
        wl = drv.wl
        if drv.B % wl.block_size:
            raise UsageError(f"--block-size {drv.B}: must be a multiple of the recorded block size {wl.block_size} "
                             "(prompts are known only as hashes of recorded-size blocks)")
        if drv.N < 2:
            raise UsageError(f"--cache-blocks {drv.N}: at least 2 (one is vLLM's null block)")
        super().__init__(drv)
        self.tier = self._tier(tier, drv)
        n = drv.N - 1
        self.queue = FreeQueue(n)
        self.bhash: list = [None] * n
        self.ref = np.zeros(n, dtype=np.int64)
        self.cached: dict = {}               # key -> [block ids holding it]
        self.head: dict = {}                 # key -> the first of them (the one a hit takes)
        self.ever: set = set()               # keys ever computed (recompute accounting)

    @staticmethod
    def _tier(name: str, drv) -> Tier | LmcacheTier:
        wl, spec = drv.wl, parse_tier(name)
        if spec.kind == "lmcache":
            return LmcacheTier(name, spec, wl.tier, drv.B, drv.stats)
        if spec.on and spec.gbps is not None and not wl.storage.block_bytes:
            raise UsageError(f"--storage-tier {name}: the dataset records no KV connector transfer to size a block by; "
                             "record a run with a connector, or give the tier without a speed (file)")
        # a loaded block's time, scaled to this block size
        ns = wl.storage.per_block_ns(spec.gbps, spec.latency_us) * (drv.B // wl.block_size) if spec.on else 0.0
        return Tier(name, ns)

    @staticmethod
    def bytes_for(cache_blocks: int) -> int:
        """The free queue's arrays, ``ref`` (int64) and ``bhash`` (a pointer) per block (the null
        block has none).  The index (cached, head, ever) and the tier grow with the workload's
        distinct hashes, not with the cache."""
        n = max(cache_blocks - 1, 0)
        return FreeQueue.bytes_for(n) + 8 * n + 8 * n

    @classmethod
    def capacity(cls, samples: pa.Table, prefix: str) -> tuple[int | None, str]:
        """num_gpu_blocks of the last cache_config_info sample that has it."""
        series, cache_blocks = prefix + "cache_config_info", None
        if not samples.num_rows:
            return None, series
        for name, labels in zip(samples.column("name").to_pylist(), samples.column("labels").to_pylist()):
            if name == series and labels and '"num_gpu_blocks"' in labels:
                try:
                    cache_blocks = int(json.loads(labels)["num_gpu_blocks"])
                except (ValueError, KeyError, TypeError):
                    pass
        return cache_blocks, series

    # -- the scheduler's rules ----------------------------------------------------------------

    def continuing(self, drv) -> int:
        """Running requests first, each its next chunk or token within the budget; an allocation
        that does not fit preempts the last running request.  No admission after a preemption."""
        running, batch = drv.running, drv.batch
        budget, preempted, i = drv.C, False, 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.computed, budget)
            while not self.alloc(r, r.computed + n):
                victim = running.pop()
                drv.requeue(victim)
                preempted = True
                if victim is r:
                    return 0
            self._hash_full(r, r.computed + n)
            batch.append((r, n))
            budget -= n
            i += 1
        return 0 if preempted else budget

    def admit(self, drv, r, budget: int) -> tuple[int, int] | None:
        """r's cached prefix, then the tier's next blocks; admitted when its whole sequence fits."""
        B, keys, tier = self.B, r.keys, self.tier
        hit = self.match(r)
        ext = tier.lookup(keys, hit, min((r.num_tokens - 1) // B, len(keys))) if tier.on else 0
        computed = (hit + ext) * B
        n = min(r.num_tokens - computed, budget)
        if not self._take(r):
            r.blocks = []
            return None
        self.alloc(r, computed + n)
        self.stats["storage_loads"] += ext
        if ext:
            drv.wait_ns += tier.load(keys, hit, ext)
        r.computed = computed
        r.hashed = hit  # hit blocks carry their hash already
        self._hash_full(r, computed + n, loaded_upto=hit + ext)
        return hit, ext

    def formed(self, drv) -> None:
        """(The batch's blocks were allocated as it was formed.)"""

    # -- the cache ----------------------------------------------------------------------------

    def match(self, r) -> int:
        """r's longest cached prefix, at most (tokens - 1) // block blocks: one lookup per block
        until the first miss (C iterators, no Python step per block); the blocks holding it
        become r.blocks, taken only by ``_take``."""
        lim = min((r.num_tokens - 1) // self.B, len(r.keys))
        r.blocks = list(takewhile(_not_none, map(self.head.get, islice(r.keys, lim))))
        hit = len(r.blocks)
        self.stats["lookups"] += hit + (1 if hit < lim else 0)
        return hit

    def _take(self, r) -> bool:
        """When r's whole sequence fits (vLLM's scheduler_reserve_full_isl), take its hit blocks
        (out of the free queue when idle) and say True; else change nothing and say False."""
        ref, queue, hits = self.ref, self.queue, r.blocks
        need = -(-r.num_tokens // self.B) - len(hits)
        if r.distinct:
            hb = as_ints(hits)
            idle = ref[hb] == 0
            evictable = int(idle.sum())
            if need + evictable > len(queue):
                return False
            if evictable:
                queue.remove(hb[idle])
            ref[hb] += 1
            return True
        evictable = sum(1 for b in hits if not ref[b])
        if need + evictable > len(queue):
            return False
        for b in hits:
            if not ref[b]:
                queue.remove([b])
            ref[b] += 1
        return True

    def alloc(self, r, tokens: int) -> bool:
        """Blocks for r's tokens below ``tokens``, popped from the free queue (a popped block that
        holds a hash is evicted); False, nothing taken, when the queue has too few."""
        k0 = -(-tokens // self.B) - len(r.blocks)
        if k0 > len(self.queue):
            return False
        if k0 > 0:
            r.blocks.extend(self._pop(k0))
        return True

    def _pop(self, n: int) -> list:
        """n blocks from the free queue's head, each held once; one that holds a hash is evicted."""
        bhash, cached, head, ref = self.bhash, self.cached, self.head, self.ref
        out = self.queue.pop(n)
        for bid in out:
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
        return out

    def _hash_full(self, r, tokens: int, loaded_upto: int = 0) -> None:
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
                    self.tier.computed(r.keys, j)
        if upto > r.hashed:
            r.hashed = upto

    def free(self, r) -> None:
        """Tail first: blocks with a hash to the back of the free queue (LRU), others to the front."""
        if not r.distinct:
            self._release(r.blocks)
        else:
            # a request's blocks at once (no block twice among them)
            ref, bhash, queue = self.ref, self.bhash, self.queue
            tail = np.fromiter(reversed(r.blocks), np.int64, len(r.blocks))
            ref[tail] -= 1
            freed = tail[ref[tail] == 0]
            hs = list(map(bhash.__getitem__, freed.tolist()))
            first = []
            if None in hs:
                freed = freed.tolist()
                queue.extend(list(compress(freed, map(operator.is_not, hs, repeat(None)))))
                first = list(compress(freed, map(operator.is_, hs, repeat(None))))
            else:
                queue.extend(freed)
            queue.extend_front(first)   # unhashed blocks to the front, the request's first of them frontmost
        r.blocks = []
        r.hashed = 0

    def _release(self, bids) -> None:
        """Blocks let go of, tail first, one at a time: a block no longer held goes to the back
        of the free queue when it holds a hash, to the front (the first of them frontmost) when not."""
        ref, bhash, first = self.ref, self.bhash, []
        for bid in reversed(bids):
            ref[bid] -= 1
            if not ref[bid]:
                if bhash[bid] is None:
                    first.append(bid)
                else:
                    self.queue.extend([bid])
        self.queue.extend_front(first)

    def free_capacity(self) -> int:
        return len(self.queue)

    def snapshot(self) -> dict:
        return {"cached": sum(map(len, self.cached.values())), "held": int((self.ref > 0).sum()),
                "free_capacity": self.free_capacity()}
