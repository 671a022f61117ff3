"""SGLang's radix cache (0.5.23, LRU) as the replay's cache: ``--cache-blocks`` KV slots of
``--block-size`` tokens (SGLang's --max-total-tokens divided by its page size; the recorded page
size is 1).

The tree's **nodes** are what SGLang inserts at once: a computed chunk, a finished request's
output; each holds its pages, keyed by the hash of their last token's prefix (the hook's
per-token chain).  A match or an insert that ends inside a node splits it there.  A running
request locks the path from its node to the root; an allocation that does not fit in the free
slots evicts unlocked **leaf nodes, whole, least recently used first** (a node's time is that of
the last match, insert or touch that walked it; a parent becomes a leaf when its last child goes).
The scheduler's rules over it: radix.RadixCache.
"""
from __future__ import annotations

import heapq

from kvtrace.analysis.whatif.cache import CacheModel


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


class RadixTree(CacheModel):
    """The tree, and the slots: ``used`` counts the tree's pages and the running requests' own
    (r.priv: pages of r's not in the tree yet); r.node is the node r's path ends in, r.held the
    pages of r's on that path."""

    def __init__(self, drv):
        super().__init__(drv)
        self.root = _Node([], 0, None, 0)
        self.at: dict = {}          # page key -> the node holding it
        self.heap: list = []        # (time, seq, node): eviction candidates, checked when popped
        self.used = 0               # slots held: tree pages plus running requests' private ones
        self.locked = 0             # tree pages some running request holds
        self.tick = self.seq = 0
        self.ever: set = set()      # keys ever computed (recompute accounting)

    def start(self, reqs: list) -> None:
        for r in reqs:
            r.priv, r.node, r.held = 0, self.root, 0

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

    def _end(self, keys: list, m: int) -> _Node:
        """The node the cached path of keys[:m] ends in, split there."""
        n = self.at[keys[m - 1]]
        return self._split(n, m - n.depth) if m - n.depth < len(n.keys) else n

    def _cached(self, keys: list, lim: int) -> int:
        """Pages of keys[:lim] in the tree (it holds prefixes whole: present up to the first miss)."""
        m, at = 0, self.at
        while m < lim and keys[m] in at:
            m += 1
        return m

    def evict(self, k: int) -> int:
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

    def room(self, k: int) -> bool:
        """Make k free slots, evicting; False (nothing evicted beyond need) when they cannot be had."""
        short = k - (self.N - self.used)
        return short <= 0 or self.evict(short) >= short

    def match(self, r) -> int:
        """Pages of r's prefix in the tree (at most those below its length - 1): the node the
        match ends in is split there, the path touched and locked (SGLang's match_prefix)."""
        lim = min((r.num_tokens - 1) // self.B, len(r.keys))
        m = self._cached(r.keys, lim)
        self.stats["lookups"] += m + (1 if m < lim else 0)
        self.tick += 1
        n = self.root
        if m:
            n = self._end(r.keys, m)
            self._touch(n, self.tick)
            self._lock(n, 1)
        r.node, r.held = n, m
        return m

    def touch_prefix(self, r) -> None:
        """SGLang's touch_prefix of a waiting request: its cached prefix (its whole sequence, not
        capped) split where it ends and touched, not locked."""
        m = self._cached(r.keys, len(r.keys))
        if m:
            self.tick += 1
            n = self._end(r.keys, m)
            self._touch(n, self.tick)
            if not n.lock and not n.children:
                self._push(n)

    def insert(self, r, upto: int) -> None:
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
            n = self._end(keys, j)
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

    def free(self, r) -> None:
        """Unlock r's path (its leaves become evictable) and free its private slots."""
        self._lock(r.node, -1)
        self.used -= r.priv
        r.priv = 0
        r.node, r.held = self.root, 0

    def pages(self, r, tokens: int) -> int:
        """The slots r's tokens below ``tokens`` need beyond those it holds."""
        return max(-(-tokens // self.B) - r.held - r.priv, 0)

    def alloc(self, r, tokens: int) -> bool:
        """Slots for r's tokens below ``tokens``, evicting; False when they cannot be had."""
        need = self.pages(r, tokens)
        if need > 0:
            if not self.room(need):
                return False
            self.used += need
            r.priv += need
        return True

    def free_capacity(self) -> int:
        return self.N - self.used + len(self.at) - self.locked

    def snapshot(self) -> dict:
        return {"cached": len(self.at), "held": self.locked + self.used - len(self.at),
                "free_capacity": self.free_capacity()}
