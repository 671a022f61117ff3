"""vLLM's free-block queue for the block pool's replay (blockpool.BlockPool): the order in which
free blocks are reused, so which cached block an allocation evicts.  ``FreeQueue.bytes_for`` says
what a queue of n blocks costs before any of it is allocated."""
from __future__ import annotations

import numpy as np


def as_ints(x) -> np.ndarray:
    """Block ids as an int64 array (np.fromiter: a list of Python ints converts faster than np.array)."""
    return x if isinstance(x, np.ndarray) else np.fromiter(x, np.int64, len(x))


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
        bids = as_ints(bids)
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
        bids = as_ints(bids)
        self.isfree[bids] = False
        self.count -= len(bids)
