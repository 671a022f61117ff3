"""The storage tier of a replay (``--storage-tier``), which only the block pool models:

* ``file[:BLOCKS][@READ_GBPS[/LATENCY_US]]``: a KV connector's store that every computed block is
  written to and a prefix is loaded back from at admission, at the tier's read speed
  (storage.StorageModel); BLOCKS bounds it (LRU).
* ``lmcache[:L1_GB][@L2_READ_GBPS[/LATENCY_US]]``: LMCache (lmcache.LmcacheTier), whole chunks in
  an L1 of L1_GB GiB (LRU) over an unbounded L2 on disk read at L2_READ_GBPS.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice, takewhile

from kvtrace.errors import UsageError

TIER_HELP = ("give none, file[:BLOCKS][@READ_GBPS[/LATENCY_US]] (e.g. file, file:4096, file@0.5, file:4096@2/100), "
             "or lmcache[:L1_GB][@L2_READ_GBPS[/LATENCY_US]] (e.g. lmcache, lmcache:0.5, lmcache:2@1)")
KINDS = ("none", "file", "lmcache")


@dataclass(frozen=True)
class TierSpec:
    kind: str                       # none, file or lmcache
    size: float | None = None       # file: blocks; lmcache: L1 bytes; None: as recorded (file: unbounded)
    gbps: float | None = None       # the read speed (lmcache: L2's); None: the recorded one
    latency_us: float | None = None

    @property
    def on(self) -> bool:
        return self.kind != "none"


def parse_tier(spec: str) -> TierSpec:
    """--storage-tier none | file[:BLOCKS][@READ_GBPS[/LATENCY_US]] | lmcache[:L1_GB][@...];
    UsageError (one line, exit 2) otherwise."""
    head, at, speed = spec.partition("@")
    kind, colon, size = head.partition(":")
    if kind not in KINDS or (kind == "none" and (colon or at)):
        raise UsageError(f"--storage-tier {spec!r}: {TIER_HELP}")
    n = None
    if colon:
        n = _size(spec, kind, size.strip())
    gbps = lat = None
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
    return TierSpec(kind, n, gbps, lat)


def _size(spec: str, kind: str, text: str) -> float:
    if kind == "file":
        try:
            blocks = int(text)
        except ValueError:
            blocks = 0
        if blocks <= 0:
            raise UsageError(f"--storage-tier {spec!r}: BLOCKS must be a whole number above 0 (e.g. file:4096), "
                             "or give file for an unbounded store")
        return blocks
    try:
        gb = float(text)
    except ValueError:
        gb = 0.0
    if not 0 < gb < float("inf"):
        raise UsageError(f"--storage-tier {spec!r}: L1_GB must be a number of GiB above 0 (e.g. lmcache:0.5), "
                         "or give lmcache for the recorded L1")
    return gb * (1 << 30)


class Tier:
    """The file tier: the store's blocks, least recently stored or loaded first; BLOCKS bounds it
    (LRU).  A loaded block costs ``load_ns`` (the block pool's block size)."""

    def __init__(self, spec: str, load_ns: float = 0.0):
        self.name = spec
        t = parse_tier(spec)
        if t.kind == "lmcache":
            raise UsageError(f"--storage-tier {spec}: an LMCache tier needs the recorded dataset (whatif.run)")
        self.on, self.gbps, self.latency_us = t.on, t.gbps, t.latency_us
        self.cap = int(t.size) if t.size is not None else None
        self.load_ns = load_ns
        self.keys: OrderedDict = OrderedDict()

    def store(self, key) -> None:
        if not self.on or key in self.keys:
            return
        self.keys[key] = None
        if self.cap is not None and len(self.keys) > self.cap:
            self.keys.popitem(last=False)

    def computed(self, keys: list, j: int) -> None:
        """Block j of a request (keys) computed: the connector stores it."""
        self.store(keys[j])

    def lookup(self, keys: list, hit: int, limit: int) -> int:
        """Blocks the tier has consecutively after the ``hit`` cached ones, up to block ``limit``."""
        return len(list(takewhile(self.keys.__contains__, islice(keys, hit, limit))))

    def load(self, keys: list, hit: int, ext: int) -> float:
        """Load blocks [hit, hit + ext): what the admission waits (ns)."""
        deque(map(self.keys.move_to_end, keys[hit:hit + ext]), 0)
        return ext * self.load_ns
