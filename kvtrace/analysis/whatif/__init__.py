"""`kvtrace whatif`: replay the recorded request stream through a model of the recorded server's
KV cache and scheduler under other settings, and predict what they would do.

Inputs, per request, from the hook's records: arrival (``arrive``), prompt as a chain of block
hashes (``prompt_blocks``; no token ids), output length (``finish.output_tokens`` when the
record has it, else the request's ``max_output``), and when it finished.  Block sizes must be
multiples of the recorded one: prompts are only known as hashes of recorded-size blocks, and a
block of k recorded blocks is named by the hash of its last one.

The stages:

* read.workload: the workload from the dataset (workload.Workload; requests.py, recorded.py,
  storage.py), with the server kind it recorded;
* driver.Replay: one replay at one setting, the clock and the scheduler loop, over the kind's
  cache model (models.MODELS, keyed by ServerKind.cache_model: blockpool.BlockPool for vLLM,
  radix.RadixCache for SGLang; cache.CacheModel is what the driver asks of one);
* here: the settings checked (settings.py), the sweep over every combination; table.py (the
  terminal) and html.py (`--html`) show the result.
"""
from __future__ import annotations

import itertools
import time

from kvtrace.analysis.whatif.blockpool import BlockPool
from kvtrace.analysis.whatif.cache import CacheModel
from kvtrace.analysis.whatif.driver import Replay
from kvtrace.analysis.whatif.freequeue import FreeQueue
from kvtrace.analysis.whatif.models import MODELS, model_for
from kvtrace.analysis.whatif.radix import RadixCache
from kvtrace.analysis.whatif.read import workload
from kvtrace.analysis.whatif.settings import MAX_COMBINATIONS, check_grid, check_memory, check_settings, memory_limit
from kvtrace.analysis.whatif.table import print_table
from kvtrace.analysis.whatif.tier import Tier
from kvtrace.analysis.whatif.workload import Req, Workload
from kvtrace.errors import DatasetError, UsageError

__all__ = ["BlockPool", "CacheModel", "FreeQueue", "MAX_COMBINATIONS", "MODELS", "RadixCache", "Replay", "Req", "Tier",
           "Workload", "memory_limit", "model_for", "print_table", "run", "workload"]


def run(directory, chunk_sizes=None, block_sizes=None, cache_blocks=None, tiers=None, max_num_seqs: int = 256,
        max_combinations: int = MAX_COMBINATIONS, say=None) -> dict:
    """The predictions for every combination; say (a callable taking a line), when given, hears the
    grid's size before the sweep and, once the first combination is timed, the time the rest take."""
    limit = memory_limit()
    check_settings(chunk_sizes, block_sizes, cache_blocks, tiers, limit)
    check_grid([chunk_sizes, block_sizes, cache_blocks, tiers], max_combinations)
    wl = workload(directory)
    rec = wl.recorded
    if not wl.reqs:
        raise DatasetError(f"{directory}: no requests to replay")
    chunk_sizes = chunk_sizes or ([rec["chunk_size"]] if rec["chunk_size"] else None)
    cache_blocks = cache_blocks or ([rec["cache_blocks"]] if rec["cache_blocks"] else None)
    if not chunk_sizes:
        raise UsageError("give --chunk-size: the dataset has no step records to read the recorded chunk budget from")
    if not cache_blocks:
        raise UsageError("give --cache-blocks: the dataset does not tell the recorded KV cache size")
    check_memory(cache_blocks, limit)  # the recorded size too
    block_sizes = block_sizes or [wl.block_size]
    tiers = tiers or [rec.get("storage_tier") or "none"]   # as recorded
    rows = _sweep(wl, list(itertools.product(chunk_sizes, block_sizes, cache_blocks, tiers)), max_num_seqs, say)
    return {"dataset": str(directory), "requests": len(wl.reqs), "recorded": rec,
            "step_model_ns": {"a": wl.model[0], "per_prefill_token": wl.model[1], "per_decode_request": wl.model[2]},
            "storage_model": wl.storage.to_json(), **_tier_model(wl, tiers), "notes": wl.notes, "predictions": rows}


def _tier_model(wl: Workload, tiers: list[str]) -> dict:
    """The LMCache model, when the dataset recorded the tier or a setting replays one."""
    if wl.tier.recorded or any(t.startswith("lmcache") for t in tiers):
        return {"tier_model": wl.tier.to_json()}
    return {}


def _sweep(wl: Workload, grid: list[tuple], max_num_seqs: int, say=None) -> list[dict]:
    """Replay every (chunk size, block size, cache blocks, tier) of grid, one at a time."""
    if say and len(grid) > 1:
        say(f"whatif: {len(grid):,} combinations of {len(wl.reqs):,} requests; timing the first for an estimate")
    rows = []
    for i, (C, B, N, T) in enumerate(grid):
        t0 = time.perf_counter()
        s = Replay(wl, C, B, N, T, max_num_seqs).run()  # one cache at a time: freed before the next is made
        dt = time.perf_counter() - t0
        rows.append({"chunk_size": C, "block_size": B, "cache_blocks": N, "storage_tier": T, **s,
                     "replay_s": round(dt, 4), "lookups_per_s": round(s["lookups"] / dt) if dt else None})
        if say and i == 0 and len(grid) > 1:
            say(f"whatif: the first combination took {dt:.3f} s: about {_seconds(dt * (len(grid) - 1))} for the "
                f"other {len(grid) - 1:,}")
    return rows


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"
