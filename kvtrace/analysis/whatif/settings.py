"""What `kvtrace whatif` refuses before it reads the dataset: settings that are not whole numbers
above 0 or not a storage tier, a grid of more combinations than --max-combinations, and a cache
whose replay would not fit in memory (the recorded size is checked again once it is known)."""
from __future__ import annotations

import numbers

from kvtrace.analysis.whatif.models import MODELS
from kvtrace.analysis.whatif.tier import parse_tier
from kvtrace.errors import UsageError
from kvtrace.units import human_bytes

# What one replay may allocate for its cache model's arrays (CacheModel.bytes_for: what they take
# whatever the workload, at their peak), as a fraction of MemAvailable.  Half, because the replays
# run one at a time beside what bytes_for does not count, which grows with the dataset (the
# requests' prompt hashes and block-id lists, the prefix index), and often on the serving host;
# past MemAvailable the OOM killer, not an error, would end the command.  A fraction rather than
# a fixed cap: the same setting fits a large host and not a small one.  Without /proc/meminfo
# (not Linux) a fixed 4 GiB.
MEMORY_SHARE = 0.5
FALLBACK_LIMIT = 4 << 30
# Combinations a sweep replays at most unless --max-combinations raises it: each replays every
# recorded request (about 35 ms for a small dataset, seconds for a large one).
MAX_COMBINATIONS = 500
AXES = ("--chunk-size", "--block-size", "--cache-blocks", "--storage-tier")


def memory_limit(meminfo: str = "/proc/meminfo") -> tuple[int, str]:
    """The bytes a replay may allocate, and where the bound comes from."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return int(kib * 1024 * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_LIMIT, "the fixed limit without /proc/meminfo"


def check_memory(cache_blocks: list[int], limit: tuple[int, str]) -> None:
    """Refuse a --cache-blocks setting whose replay would not fit in ``limit`` (bytes, where it
    comes from), whichever cache model replays it (one line, exit 2)."""
    for n in cache_blocks:
        need = max(m.bytes_for(n) for m in MODELS.values())
        if need > limit[0]:
            raise UsageError(f"--cache-blocks {n}: the replay's block pool would need up to {human_bytes(need)}, "
                             f"more than the limit of {human_bytes(limit[0])} ({limit[1]}); give fewer blocks")


def check_settings(chunk_sizes, block_sizes, cache_blocks, tiers, limit: tuple[int, str]) -> None:
    """What a replay can be refused for without the dataset."""
    for name, values in (("--chunk-size", chunk_sizes), ("--block-size", block_sizes), ("--cache-blocks", cache_blocks)):
        for v in values or ():
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise UsageError(f"{name} {v!r}: give whole numbers above 0")
    for t in tiers or ():
        parse_tier(t)
    check_memory(cache_blocks or [], limit)


def check_grid(values: list, limit: int) -> int:
    """The number of combinations of the swept values (a list, or None: as recorded, one value);
    UsageError (exit 2) above limit."""
    n = 1
    for v in values:
        n *= len(v) if v else 1
    if n > limit:
        axes = " × ".join(f"{len(v)} {a}" for a, v in zip(AXES, values) if v and len(v) > 1)
        raise UsageError(f"the grid has {n:,} combinations ({axes}), more than --max-combinations {limit:,}: give "
                         f"fewer values, or raise --max-combinations (each combination replays every recorded request)")
    return n
