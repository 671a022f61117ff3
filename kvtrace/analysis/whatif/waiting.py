"""The replay's waiting queue (driver.Replay), in the order docs/analysis.md, "The replay's
order" gives: at the recorded setting the recorded order of first admissions, else arrival order."""
from __future__ import annotations

from collections import deque


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

    def append(self, r) -> None:
        self.ready[r.rank if self.ordered else id(r)] = r

    def appendleft(self, r) -> None:
        self.back.appendleft(r)

    def _head(self):
        if self.back:
            return self.back[0]
        if not self.ordered:
            return next(iter(self.ready.values()), None)
        return self.ready.get(self.next)

    def __bool__(self) -> bool:
        return self._head() is not None

    def __getitem__(self, i: int):
        r = self._head()
        if i or r is None:
            raise IndexError(i)
        return r

    def popleft(self):
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
