"""Attribution: which step, chunk, request and KV transfer each recorded event belongs to.

Pure functions over recorded tables (no root, no bcc), used live (kvtrace.correlate.live, on a
sliding window) and offline (kvtrace.correlate.derive, on a whole run).  The rules, in order
(docs/correlate.md):

* Steps.  A step is EngineCore's window [t_start_ns, t_end_ns] (schedule() start to
  update_from_output() end).  A time inside several windows (async scheduling overlaps steps)
  belongs to the earliest of them; ``candidates`` says how many windows contained it.
* Chunks, admissions, evictions, preemptions name their step and request: ``exact_id``.
* KV transfers (kv_load/kv_store) go to the step whose window holds their start.  One that names
  its request is ``exact_id`` to that request, and to the request's chunk in that step; an unnamed
  one (the per-step connector record) is ``shared`` by the step.
* Kernel storage I/O (block_io, storage file_io, io_uring data ops) issued on the thread of a KV
  transfer while that transfer runs is ``thread_time`` to it (a transfer naming its request wins
  over an unnamed one), and through it to its step, request and chunk.  Other storage I/O of the
  engine's processes goes to the step holding its start, ``shared``: nothing names the request,
  so chunks get a share in proportion to their scheduled tokens.  Outside every step: ``none``.
* NVMe commands (nvme_cmd: setup -> completion, weighted by their sampling weight) and NIC
  counter deltas (nic_counters: the polling interval before ts_ns) go to every step their
  interval overlaps, ``time_overlap``, with share = the overlapped fraction of the interval.
* Every token of every admission gets its miss cause (or hit) from a replay of the prefix
  cache over the final steps (kvtrace.correlate.causes).

Each rule is a stage in kvtrace.correlate.stages (one module per stage, each a pure function
of the pass's Context and earlier stages' outputs); correlate() below runs them in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvtrace.correlate.causes import CacheReplay, Segment
from kvtrace.correlate.stages.attributions import attributions
from kvtrace.correlate.stages.causes import STRUCTURE, cache_causes, with_chunk_causes
from kvtrace.correlate.stages.chunk_table import chunk_rows, chunk_sums, chunks_table
from kvtrace.correlate.stages.chunks import Chunks, index_chunks
from kvtrace.correlate.stages.context import Context, context
from kvtrace.correlate.stages.evictions import (Evictions, Preemptions, evict_records, evictions, preempt_records,
                                                preemptions)
from kvtrace.correlate.stages.nvme import Nvme, nvme_commands, step_nvme
from kvtrace.correlate.stages.overlap import Overlaps, overlaps
from kvtrace.correlate.stages.requests import RequestRecords, request_records, trace_ids
from kvtrace.correlate.stages.spans import spans
from kvtrace.correlate.stages.steps import step_aggregates, steps_table
from kvtrace.correlate.stages.storage_io import KernelIO, storage_io
from kvtrace.correlate.stages.transfers import Transfers, kv_transfers

# The names this module defined before its stages moved to kvtrace.correlate.stages, still
# importable from here.
from kvtrace.correlate.inputs import OVERLAP_PREFIXES, Cols, columns, overlap_columns  # noqa: F401
from kvtrace.correlate.stages.attributions import _D, ATTR_TYPES  # noqa: F401
from kvtrace.correlate.stages.context import (EXACT, HOW, MAXBACK, NONE, OVERLAP, SHARED, THREAD,  # noqa: F401
                                              StepIndex, engine_map, locate)
from kvtrace.correlate.stages.nvme import NVME_COLS, NVME_TEXT  # noqa: F401
from kvtrace.correlate.stages.nvme import issuer_match as _thread_match  # noqa: F401
from kvtrace.correlate.stages.nvme import nvme_add as _nvme_add  # noqa: F401
from kvtrace.correlate.stages.nvme import nvme_group as _nvme_group  # noqa: F401
from kvtrace.correlate.stages.nvme import nvme_rows as _nvme_rows  # noqa: F401
from kvtrace.correlate.stages.spans import io_group as _group  # noqa: F401
from kvtrace.correlate.stages.steps import _union_len, bottleneck  # noqa: F401


@dataclass
class Result:
    """What one correlation pass decided, for the steps it finalised."""

    steps: pa.Table
    chunks: pa.Table
    attributions: pa.Table
    transfers: list[dict] = field(default_factory=list)      # finalised KV transfers, attributed
    io_groups: list[dict] = field(default_factory=list)      # kernel I/O per transfer, for spans
    evicts: list[dict] = field(default_factory=list)
    preempts: list[dict] = field(default_factory=list)
    admits: list[dict] = field(default_factory=list)
    arrives: list[dict] = field(default_factory=list)        # every arrive row seen (not only final)
    finishes: list[dict] = field(default_factory=list)
    done: dict[str, np.ndarray] = field(default_factory=dict)  # per input table: rows decided
    nvme_groups: list[dict] = field(default_factory=list)    # NVMe commands per step and queue, for chunk spans
    segments: list[Segment] = field(default_factory=list)   # the miss causes of the final admissions
    connector: list[dict] = field(default_factory=list)     # kv_alloc / kv_done rows (kvtrace.correlate.requests)


def correlate(tables: dict[str, pa.Table], run: str = "", final_before: int | None = None,
              horizon: int | None = None, io_span_bytes: int = 1 << 20, replay: CacheReplay | None = None) -> Result:
    """Attribute the rows of ``tables`` (one run of one host).

    final_before: only steps that ended before this time are finalised (live use); None = all.
    horizon: rows that start before it and fall in no step are final too (default final_before).
    io_span_bytes: block I/O at least this large gets its own span; smaller ones are aggregated
    per transfer, device and direction.
    replay: the prefix-cache replay of the miss causes, kept over passes (live use); None = new.
    """
    ctx = context(tables, run, final_before, horizon, io_span_bytes)
    replay = replay if replay is not None else CacheReplay()
    # placement: each event's step, request, chunk and transfer
    traces = trace_ids(ctx)
    chunks = index_chunks(ctx)
    transfers = kv_transfers(ctx, chunks)
    kio = storage_io(ctx, transfers)
    ev, pr = evictions(ctx, chunks), preemptions(ctx, chunks)
    ov = overlaps(ctx)
    nvme = nvme_commands(ctx, transfers)
    req = request_records(ctx, chunks)
    segments = cache_causes(ctx, chunks, ev, pr, req.finish_final, replay)
    # the derived tables
    per_step = step_aggregates(ctx, transfers, kio)
    steps_tbl = steps_table(ctx, per_step, chunks, ev, pr, ov)
    step_nv = step_nvme(ctx, nvme, ov, chunks)
    chunks_tbl = with_chunk_causes(chunks_table(chunks, chunk_sums(chunks, transfers, kio, ev, pr),
                                                chunk_rows(ctx, chunks, traces, per_step, ov, step_nv)), replay)
    attributions_tbl = attributions(ctx, chunks, transfers, kio, ev, pr, nvme, ov)
    # what the spans and the request accumulators need
    tr_spans, io_groups = spans(ctx, chunks, transfers, kio, nvme)
    return Result(steps=steps_tbl, chunks=chunks_tbl, attributions=attributions_tbl, transfers=tr_spans,
                  io_groups=io_groups, evicts=evict_records(ev, chunks), preempts=preempt_records(pr, chunks),
                  admits=req.admits, arrives=req.arrives, finishes=req.finishes,
                  done=decided(ctx, chunks, transfers, kio, ev, pr, ov, nvme, req), nvme_groups=step_nv.groups,
                  segments=segments, connector=req.connector)


def decided(ctx: Context, chunks: Chunks, transfers: Transfers, kio: dict[str, KernelIO], ev: Evictions,
            pr: Preemptions, ov: Overlaps, nvme: Nvme, req: RequestRecords) -> dict[str, np.ndarray]:
    """Per input table: the rows this pass is done with (the live window drops them)."""
    over = dict(ov.done)
    if nvme.pending is not None and "nvme_cmd" in over:
        # a command issued by a transfer's thread stays until that transfer is decided
        over["nvme_cmd"] = over["nvme_cmd"] & ~nvme.pending
    n_load = transfers.n_load
    return {"step": ctx.final, "admit": chunks.admit_final, "finish": req.finish_final, "chunk": chunks.final,
            "evict": ev.final, "preempt": pr.final, "kv_load": transfers.final[:n_load],
            "kv_store": transfers.final[n_load:], "kv_alloc": np.ones(ctx.cols["kv_alloc"].n, bool),
            "kv_done": np.ones(ctx.cols["kv_done"].n, bool), **{name: k.decided(ctx.horizon) for name, k in kio.items()}, **over,
            **{name: np.ones(ctx.tables[name].num_rows, bool) for name in STRUCTURE if name in ctx.tables}}
