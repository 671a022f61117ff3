"""vLLM's block pool for a hybrid model: one pool, one manager per KV cache group (the dataset's
kv_group rows), as blockpool.BlockPool models the one-group case.

* Every group holds blocks for a request's tokens; a block is cached under (hash, group).
* Full attention: a block is hashed when allocated and held until the request leaves.
* Sliding window: before each allocation the blocks wholly below the window (tokens before
  computed - window + 1) are freed (to the back of the free queue, their hashes kept); a block
  is hashed only where the group's retention keeps it (kvtrace.correlate.hybrid.GroupSpec.keeps:
  by default the blocks a hit at the prompt's end or at a shared-prefix junction needs); the
  admission reserves at most cdiv(window - 1 + chunk, block) blocks of it.
* The hit: full attention's cached prefix, then each window group's rule over it (the last
  cdiv(window - 1, block) blocks cached, right to left; kvtrace.correlate.hybrid), aligned to
  the match unit.  A window group takes only the blocks of the run that matched.
Other kinds of group (Mamba, chunked local) are refused: their managers are not modelled.
"""
from __future__ import annotations

from kvtrace.analysis.whatif.blockpool import BlockPool
from kvtrace.correlate.hybrid import FULL, WINDOW, GroupSpec
from kvtrace.errors import UsageError

NULL = -1


class HybridPool(BlockPool):
    name = "hybrid_pool"

    def __init__(self, drv, tier: str = "none"):
        super().__init__(drv, tier)
        specs: dict[int, GroupSpec] = drv.wl.groups
        odd = sorted({s.kind for s in specs.values()} - {FULL, WINDOW})
        if odd:
            raise UsageError(f"whatif models full-attention and sliding-window KV cache groups; this model also has "
                             f"{', '.join(odd)}")
        if tier != "none":
            raise UsageError(f"--storage-tier {tier}: a hybrid model's replay has no storage tier; use none")
        if drv.B != drv.wl.block_size:
            raise UsageError(f"--block-size {drv.B}: a hybrid model replays at its recorded block size "
                             f"{drv.wl.block_size} (each group's rule is read per block)")
        self.specs = specs
        self.full = [g for g, s in sorted(specs.items()) if s.kind == FULL]
        self.windows = [g for g, s in sorted(specs.items()) if s.kind == WINDOW]
        self.align = max(max((s.align for s in specs.values()), default=drv.B) // drv.B, 1)
        self.C = drv.C
        self.junction: dict = {}       # id(request) -> its shared-prefix junction (tokens), when its hit was cut

    # -- the hit ------------------------------------------------------------------------------

    def match(self, r) -> int:
        B, keys, head = self.B, r.keys, self.head
        lim = min((r.num_tokens - 1) // B, len(keys))
        full = 0
        while full < lim and all((keys[full], g) in head for g in self.full):
            full += 1
        hit, runs = full, {}
        for _ in range(len(self.windows) + 1):   # vLLM's fixed point
            changed = False
            for g in self.windows:
                n, start = self._window(g, keys, hit)
                runs[g] = start
                if n < hit:
                    hit, changed = n, True
            if not changed:
                break
        hit -= hit % self.align
        if hit < full:
            self.junction[id(r)] = full * B
        self.stats["lookups"] += full + (1 if full < lim else 0)
        r.blocks = {g: [head[(keys[i], g)] for i in range(hit)] for g in self.full}
        for g in self.windows:
            start = min(runs.get(g, 0), hit)
            r.blocks[g] = [NULL] * start + [head[(keys[i], g)] for i in range(start, hit)]
        return hit

    def _window(self, g: int, keys, upto: int) -> tuple[int, int]:
        """(blocks group g lets hit of the first ``upto``, the first block of the run it takes)."""
        need, head, run = self.specs[g].need(self.B), self.head, 0
        for i in range(upto - 1, -1, -1):
            if (keys[i], g) in head:
                run += 1
                if run >= need:
                    return i + run, i
            else:
                run = 0
        return run, 0

    def _take(self, r) -> bool:
        ref, queue, B = self.ref, self.queue, self.B
        total = -(-r.num_tokens // B)
        need, idle = 0, []
        for g, blocks in r.blocks.items():
            real = [b for b in blocks if b != NULL]
            cap = total if g in self.full else min(total, -(-(self.specs[g].window - 1 + self.C) // B))
            need += max(cap - len(real), 0)
            idle += [b for b in real if not ref[b]]
        idle = list(dict.fromkeys(idle))
        if need + len(idle) > len(queue):
            return False
        if idle:
            queue.remove(idle)
        for blocks in r.blocks.values():
            for b in blocks:
                if b != NULL:
                    ref[b] += 1
        return True

    # -- allocation, hashing, freeing -----------------------------------------------------------

    def alloc(self, r, tokens: int) -> bool:
        if not isinstance(r.blocks, dict):
            r.blocks = {g: [] for g in self.specs}
        for g in self.windows:
            self._skip(r, g)
        want = -(-tokens // self.B)
        k = sum(max(want - len(r.blocks[g]), 0) for g in self.specs)
        if k > len(self.queue):
            return False
        if k:
            for g in self.specs:
                n = want - len(r.blocks[g])
                if n > 0:
                    r.blocks[g].extend(self._pop(n))
        return True

    def _skip(self, r, g: int) -> None:
        """Free group g's blocks wholly below the window of r's next token."""
        skipped = max(r.computed - self.specs[g].window + 1, 0) // self.B
        blocks = r.blocks[g]
        gone = [b for b in blocks[:skipped] if b != NULL]
        if not gone:
            return
        blocks[:skipped] = [NULL] * min(skipped, len(blocks))
        self._release(gone)

    def _hash_full(self, r, tokens: int, loaded_upto: int = 0) -> None:
        B, bhash, cached, ever = self.B, self.bhash, self.cached, self.ever
        upto = min(tokens, r.num_tokens) // B
        hashed = r.hashed if isinstance(r.hashed, int) else 0
        junction = self.junction.get(id(r), 0)
        for j in range(hashed, upto):
            if j >= len(r.keys):
                r.keys.append(("o", id(r), j))
            k = r.keys[j]
            for g, blocks in r.blocks.items():
                bid = blocks[j] if j < len(blocks) else NULL
                if bid == NULL or bhash[bid] is not None:
                    continue
                if g not in self.full and not self.specs[g].keeps(j, B, r.prompt_len, junction):
                    continue
                key = (k, g)
                bhash[bid] = key
                if key in cached:
                    cached[key].append(bid)
                else:
                    cached[key] = [bid]
                    self.head[key] = bid
            if j >= loaded_upto:
                if k in ever:
                    self.stats["recomputed_tokens"] += B
                else:
                    ever.add(k)
        if upto > hashed:
            r.hashed = upto

    def free(self, r) -> None:
        if isinstance(r.blocks, dict):
            for g in sorted(r.blocks, reverse=True):
                self._release([b for b in r.blocks[g] if b != NULL])
        r.blocks = []
        r.hashed = 0
        self.junction.pop(id(r), None)

    def snapshot(self) -> dict:
        return {"cached": sum(map(len, self.cached.values())), "held": int((self.ref > 0).sum()),
                "free_capacity": self.free_capacity()}
