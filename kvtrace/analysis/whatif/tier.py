"""The storage tier of a replay (``--storage-tier``): a KV connector's store that every computed
block is written to and a prefix is loaded back from at admission, at the tier's read speed
(storage.StorageModel).  Only the block pool models one."""
from __future__ import annotations

from collections import OrderedDict

from kvtrace.errors import UsageError

TIER_HELP = ("give none, or file[:BLOCKS][@READ_GBPS[/LATENCY_US]] (e.g. file, file:4096, file@0.5, "
             "file:4096@2/100)")


class Tier:
    """The store's blocks, least recently stored or loaded first; BLOCKS bounds it (LRU)."""

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
