"""`kvtrace whatif`: replay the recorded request stream through a model of vLLM's prefix cache
and scheduler (vLLM 0.32, v1 engine) under other settings, and predict what they would do.

Inputs, per request, from the hook's records: arrival (``arrive``), prompt as a chain of block
hashes (``prompt_blocks``; no token ids), output length (``finish.output_tokens`` when the
record has it, else the request's ``max_output``), and when it finished (the step before the
``finish`` record).  The model:

* KV cache: ``cache_blocks`` blocks, one of them vLLM's null block.  Free blocks form one queue;
  allocation pops its head, and a popped block that still holds a hash is an **eviction**.  A
  finished or preempted request frees its blocks tail first; blocks with a hash go to the back
  (LRU), blocks without one to the front.  Full blocks are hashed when allocated (so a request
  admitted later in the same step can hit them); output blocks get hashes no prompt shares.
* Admission (waiting queue, FCFS, only in steps without a preemption): the longest cached
  prefix, at most ``(tokens - 1) // block`` blocks; then the storage tier's consecutive blocks;
  admitted only if the whole sequence fits (vLLM's ``scheduler_reserve_full_isl``).  Hits are
  counted at first admission only, as in the analysis.
* Steps: running requests first (prefill chunks, then 1 token per decode), each within the
  chunk budget; an allocation that fails preempts the last running request.  A step lasts
  ``a + b·prefill tokens + c·decode requests`` with a, b, c fitted to the recorded steps that
  loaded nothing, plus the time its admissions wait for blocks loaded from the storage tier
  (kvtrace.analysis.whatif_storage: per block, the connector's recorded own work plus the read
  at the recorded speed or at ``@READ_GBPS[/LATENCY_US]``).
* At the recorded setting the replay keeps the recording's time: recorded arrivals, the recorded
  steps' lengths, first admissions in the recorded order (it gives the recorded run back).
* At any other setting, arrivals: a request sent within 100 ms of another's finish is replayed as
  sent that long after that request finishes in the replay (a closed-loop client); others keep
  their recorded time (docs/analysis.md, "The replay's order").

An SGLang dataset (its hook's engine records) is replayed through a model of SGLang's radix
cache and scheduler instead: kvtrace.analysis.whatif_radix.

Block sizes must be multiples of the recorded one: prompts are only known as hashes of
recorded-size blocks, and a block of k recorded blocks is named by the hash of its last one.

The pieces: the workload read from the dataset (whatif_workload), the KV cache and storage tier
(whatif_cache), the scheduler (whatif_replay); here the settings checked, the sweep and the table.
Their public names stay importable from here.
"""
from __future__ import annotations

import itertools
import numbers
import time

from kvtrace.analysis.whatif_cache import BlockPool, FreeQueue, Tier, _ints, parse_tier  # noqa: F401 (re-exported)
from kvtrace.analysis.whatif_radix import RadixReplay
from kvtrace.analysis.whatif_replay import Replay, _not_none  # noqa: F401 (re-exported)
from kvtrace.analysis.whatif_workload import (CLOSED_LOOP_NS, Req, Workload, _col, fit_steps,  # noqa: F401 (re-exported)
                                              recorded_figures, workload)
from kvtrace.errors import DatasetError, UsageError
from kvtrace.units import human_bytes

# What one replay may allocate for its block pool (BlockPool.bytes_for: the arrays it allocates
# whatever the workload, at their peak), as a fraction of MemAvailable.  Half, because the replays
# run one at a time beside what BlockPool.bytes_for does not count, which grows with the dataset
# (the requests' prompt hashes and block-id lists, the prefix index), and often on the serving
# host; past MemAvailable the OOM killer, not an error, would end the command.  A fraction rather
# than a fixed cap: the same setting fits a large host and not a small one.  Without /proc/meminfo
# (not Linux) a fixed 4 GiB.
MEMORY_SHARE = 0.5
FALLBACK_LIMIT = 4 << 30


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


def check_memory(cache_blocks: list[int]) -> None:
    """Refuse a --cache-blocks setting whose block pool would not fit (one line, exit 2)."""
    limit, source = memory_limit()
    for n in cache_blocks:
        need = BlockPool.bytes_for(n)
        if need > limit:
            raise UsageError(f"--cache-blocks {n}: the replay's block pool would need up to {human_bytes(need)}, "
                             f"more than the limit of {human_bytes(limit)} ({source}); give fewer blocks")


def check_settings(chunk_sizes, block_sizes, cache_blocks, tiers) -> None:
    """What a replay can be refused for without the dataset: checked before it is read."""
    for name, values in (("--chunk-size", chunk_sizes), ("--block-size", block_sizes), ("--cache-blocks", cache_blocks)):
        for v in values or ():
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise UsageError(f"{name} {v!r}: give whole numbers above 0")
    for t in tiers or ():
        parse_tier(t)
    check_memory(cache_blocks or [])


# Combinations a sweep replays at most unless --max-combinations raises it: each replays every
# recorded request (about 35 ms for a small dataset, seconds for a large one).
MAX_COMBINATIONS = 500
AXES = ("--chunk-size", "--block-size", "--cache-blocks", "--storage-tier")


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


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def run(directory, chunk_sizes=None, block_sizes=None, cache_blocks=None, tiers=None, max_num_seqs: int = 256,
        max_combinations: int = MAX_COMBINATIONS, say=None) -> dict:
    """The predictions for every combination; say (a callable taking a line), when given, hears the
    grid's size before the sweep and, once the first combination is timed, the time the rest take."""
    check_settings(chunk_sizes, block_sizes, cache_blocks, tiers)
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
    check_memory(cache_blocks)  # the recorded size too
    block_sizes = block_sizes or [wl.block_size]
    tiers = tiers or ["none"]
    rows = _sweep(wl, list(itertools.product(chunk_sizes, block_sizes, cache_blocks, tiers)), max_num_seqs, say)
    return {"dataset": str(directory), "requests": len(wl.reqs), "recorded": rec,
            "step_model_ns": {"a": wl.model[0], "per_prefill_token": wl.model[1], "per_decode_request": wl.model[2]},
            "storage_model": wl.storage.to_json(), "notes": wl.notes, "predictions": rows}


def _sweep(wl: Workload, grid: list[tuple], max_num_seqs: int, say=None) -> list[dict]:
    """Replay every (chunk size, block size, cache blocks, tier) of grid, one at a time."""
    if say and len(grid) > 1:
        say(f"whatif: {len(grid):,} combinations of {len(wl.reqs):,} requests; timing the first for an estimate")
    rows = []
    for i, (C, B, N, T) in enumerate(grid):
        t0 = time.perf_counter()
        kind = RadixReplay if wl.engine == "sglang" else Replay
        s = kind(wl, C, B, N, T, max_num_seqs).run()  # one pool at a time: freed before the next is made
        dt = time.perf_counter() - t0
        rows.append({"chunk_size": C, "block_size": B, "cache_blocks": N, "storage_tier": T, **s,
                     "replay_s": round(dt, 4), "lookups_per_s": round(s["lookups"] / dt) if dt else None})
        if say and i == 0 and len(grid) > 1:
            say(f"whatif: the first combination took {dt:.3f} s: about {_seconds(dt * (len(grid) - 1))} for the "
                f"other {len(grid) - 1:,}")
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.1f}"


def print_table(res: dict, wide: bool = False) -> None:
    from rich.console import Console

    from kvtrace.analysis.render import WIDE, Col, Term  # lazy: rich's console only for the terminal table

    c = Console(width=WIDE) if wide else Console()
    rec = res["recorded"]
    if rec.get("engine") == "sglang":
        c.print("SGLang: its radix cache replayed (kvtrace.analysis.whatif_radix): block = page "
                f"({rec['block_size']} token), cache blocks = --max-total-tokens / page size")
    c.print(f"recorded: {res['requests']} requests, chunk budget ≥ {rec['chunk_size']}, block size {rec['block_size']}, "
            f"{rec['cache_blocks']} cache blocks ({rec['cache_blocks_from']}); hit rate "
            f"{_pct(rec['hit_rate'])}, {rec['evictions']:,} evictions, {rec['preemptions']} preemptions, "
            f"TTFT p50 {_ms(rec['ttft']['p50_ns'])} ms")
    sm = res["storage_model"]
    if sm["fitted_on_loads"]:
        gb = sm["recorded_read_gbps"]
        c.print(f"storage: {sm['block_bytes']:,} bytes a block; {sm['read_ns_per_block'] / 1e3:,.1f} µs reading it"
                + (f" ({gb:.3f} GB/s)" if gb else "") + f" + {sm['fixed_ns_per_block'] / 1e3:,.1f} µs of the connector's own, "
                f"from {sm['fitted_on_loads']} recorded loads")
    cols = [Col("chunk"), Col("block", 2), Col("cache blocks", 2), Col("tier", justify="left"), Col("hit rate"),
            Col("hit tokens (local+storage)", 3), Col("recomputed tokens", 3), Col("evictions", 2),
            Col("storage loads (blocks)", 3), Col("storage wait ms", 1), Col("TTFT p50 ms"), Col("TTFT p90 ms", 1),
            Col("output tok/s", 1), Col("preemptions", 3), Col("steps", 3)]
    rows = [[str(r["chunk_size"]), str(r["block_size"]), str(r["cache_blocks"]), r["storage_tier"],
             "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.2f}%",
             f"{r['hit_local']:,}+{r['hit_external']:,}", f"{r['recomputed_tokens']:,}", f"{r['evictions']:,}",
             f"{r['storage_loads']:,}", _ms(r["storage_wait_ns"]), _ms(r["ttft_p50_ns"]), _ms(r["ttft_p90_ns"]),
             "-" if r["output_tokens_per_s"] is None else f"{r['output_tokens_per_s']:,.1f}",
             str(r["preemptions"]), f"{r['steps']:,}"] for r in res["predictions"]]
    Term(c, wide, hint="--json shows them").table("whatif: predictions per setting", cols, rows)
    for n in res["notes"]:
        c.print(f"note: {n}")
