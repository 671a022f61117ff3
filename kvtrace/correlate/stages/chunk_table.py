"""The chunks table: per chunk this pass finalises, what it loaded, stored, read and evicted
(through the events placed on it), its admission's cache hits, and its step's window, storage
wait, NVMe commands and shared I/O (a batched step's shared bytes split by its tokens)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.correlate import ids
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import Context
from kvtrace.correlate.stages.evictions import Evictions, Preemptions
from kvtrace.correlate.stages.nvme import StepNvme
from kvtrace.correlate.stages.overlap import Overlaps
from kvtrace.correlate.stages.requests import Traces
from kvtrace.correlate.stages.steps import StepAgg, bottleneck
from kvtrace.correlate.stages.storage_io import KernelIO
from kvtrace.correlate.stages.transfers import Transfers

CHUNK_SUMS = ("evicted_blocks", "preempted_others", "load_count", "load_blocks", "load_bytes", "load_ns", "store_count",
              "store_bytes", "file_read_bytes", "block_read_bytes")
STEP_COLS = ("t_start_ns", "t_end_ns", "sched_ns", "storage_wait_ns", "compute_ns", "step_tokens", "shared_file_bytes",
             "shared_block_bytes")


def chunk_sums(chunks: Chunks, transfers: Transfers, kio: dict[str, KernelIO], ev: Evictions,
               pr: Preemptions) -> dict[str, np.ndarray]:
    """Per chunk row (final or not): the events placed on it, summed (CHUNK_SUMS)."""
    nc, tr, tr_chunk = chunks.ch.n, transfers.tr, transfers.chunk
    cagg = {k: np.zeros(nc, np.int64) for k in CHUNK_SUMS}
    if not nc:
        return cagg
    m = ev.chunk >= 0
    np.add.at(cagg["evicted_blocks"], ev.chunk[m], 1)
    m = pr.for_chunk >= 0
    np.add.at(cagg["preempted_others"], pr.for_chunk[m], 1)
    for i in np.flatnonzero(tr_chunk >= 0).tolist():
        j = int(tr_chunk[i])
        d = tr["dir"][i]
        cagg[f"{d}_count"][j] += 1
        cagg[f"{d}_bytes"][j] += int(tr["nbytes"][i])
        if d == "load":
            cagg["load_blocks"][j] += int(tr["blocks"][i])
            cagg["load_ns"][j] += int(tr["t_end_ns"][i]) - int(tr["t_start_ns"][i])
    for name, col in (("file_io", "file_read_bytes"), ("block_io", "block_read_bytes")):
        k = kio[name]
        m = (k.transfer >= 0) & k.x["is_read"]
        tc = tr_chunk[k.transfer[m]] if m.any() else np.zeros(0, np.int64)
        ok = tc >= 0
        np.add.at(cagg[col], tc[ok], k.x["bytes"][m][ok].astype(np.int64))
    return cagg


def chunk_rows(ctx: Context, chunks: Chunks, traces: Traces, agg: StepAgg, ov: Overlaps,
               step_nv: StepNvme) -> dict[str, list]:
    """Per final chunk (in row order): the columns that come from its admission, its step and its trace."""
    steps, ch, ad, ch_step = ctx.steps, chunks.ch, chunks.admit, chunks.step
    sched_ns, storage_wait, compute, io_sum = agg.sched_ns, agg.storage_wait, agg.compute, agg.io
    rows = {k: [] for k in ("cached_tokens", "cached_local", "cached_external", "hit_blocks", "t_start_ns",
                            "t_end_ns", "sched_ns", "storage_wait_ns", "compute_ns", "step_tokens",
                            "shared_file_bytes", "shared_block_bytes", "bottleneck", "trace_id", "span_id",
                            "parent_span_id", "nvme_commands", "nvme_bytes", "nvme_latency_avg_ns",
                            "nvme_latency_max_ns")}
    for i in np.flatnonzero(chunks.final).tolist():
        s = int(ch_step[i])
        rows["nvme_commands"].append(float(ov.nvme_cmds[s]) if s >= 0 else 0.0)
        rows["nvme_bytes"].append(float(ov.nvme_bytes[s]) if s >= 0 else 0.0)
        rows["nvme_latency_avg_ns"].append(float(step_nv.latency_avg[s]) if s >= 0 else 0.0)
        rows["nvme_latency_max_ns"].append(int(step_nv.latency_max[s]) if s >= 0 else 0)
        r = ch["request"][i]
        first = int(ch["chunk_index"][i]) == 0
        a = chunks.admit_of.get((int(ch["pid"][i]), r, int(ch["attempt"][i]))) if first else None
        loc = int(ad["cached_local"][a]) if a is not None else 0
        ext = int(ad["cached_external"][a]) if a is not None else 0
        rows["cached_local"].append(loc)
        rows["cached_external"].append(ext)
        rows["cached_tokens"].append(loc + ext)
        rows["hit_blocks"].append(int(ad["hit_blocks"][a]) if a is not None else 0)
        if s >= 0:
            tot = max(int(steps["total_tokens"][s]), 1)
            frac = int(ch["length"][i]) / tot
            rows["t_start_ns"].append(int(steps["t_start_ns"][s]))
            rows["t_end_ns"].append(int(steps["t_end_ns"][s]))
            rows["sched_ns"].append(int(sched_ns[s]))
            rows["storage_wait_ns"].append(int(storage_wait[s]))
            rows["compute_ns"].append(int(compute[s]))
            rows["step_tokens"].append(int(steps["total_tokens"][s]))
            rows["shared_file_bytes"].append(int(io_sum["shared_file_bytes"][s] * frac))
            rows["shared_block_bytes"].append(int(io_sum["shared_block_bytes"][s] * frac))
            rows["bottleneck"].append(bottleneck(int(sched_ns[s]), int(storage_wait[s]), int(compute[s]),
                                                 bool(ch["resumed"][i])))
        else:  # the step record was lost: the chunk has no window
            for k in STEP_COLS:
                rows[k].append(0)
            rows["bottleneck"].append("unknown")
        tid, _, _ = traces.of(r)
        rows["trace_id"].append(tid.hex())
        rows["span_id"].append(ids.chunk_span(tid, r, int(ch["attempt"][i]), int(ch["step"][i])).hex())
        rows["parent_span_id"].append(ids.request_span(tid, r).hex())
    return rows


def chunks_table(chunks: Chunks, cagg: dict[str, np.ndarray], rows: dict[str, list]) -> pa.Table:
    """The chunks table (docs/schema.md) from the chunk records, chunk_sums and chunk_rows."""
    ch, cs = chunks.ch, np.flatnonzero(chunks.final)
    u32, u64, i64, f64 = pa.uint32(), pa.uint64(), pa.int64(), pa.float64()
    return pa.table({
        "engine_pid": pa.array(ch["pid"][cs], u32),
        "step": pa.array(ch["step"][cs], u64),
        "request": pa.array(ch["request"][cs].tolist(), pa.string()),
        "attempt": pa.array(ch["attempt"][cs], u32),
        "chunk_index": pa.array(ch["chunk_index"][cs], pa.int32()),
        "token_start": pa.array(ch["start"][cs], u32),
        "token_end": pa.array(ch["start"][cs].astype(np.int64) + ch["length"][cs], u32),
        "tokens": pa.array(ch["length"][cs], u32),
        "prompt_len": pa.array(ch["prompt_len"][cs], u32),
        "prefill_len": pa.array(ch["prefill_len"][cs], u32),
        "last": pa.array(ch["last"][cs].astype(bool), pa.bool_()),
        "resumed": pa.array(ch["resumed"][cs].astype(bool), pa.bool_()),
        **{k: pa.array(rows[k], u32) for k in ("cached_tokens", "cached_local", "cached_external", "hit_blocks")},
        **{k: pa.array(cagg[k][cs], t) for k, t in (
            ("evicted_blocks", u32), ("preempted_others", u32), ("load_count", u32), ("load_blocks", u32),
            ("load_bytes", u64), ("load_ns", i64), ("store_count", u32), ("store_bytes", u64),
            ("file_read_bytes", u64), ("block_read_bytes", u64))},
        **{k: pa.array(rows[k], t) for k, t in (
            ("storage_wait_ns", i64), ("compute_ns", i64), ("sched_ns", i64), ("step_tokens", u32),
            ("shared_file_bytes", u64), ("shared_block_bytes", u64), ("nvme_commands", f64), ("nvme_bytes", f64),
            ("nvme_latency_avg_ns", f64), ("nvme_latency_max_ns", i64), ("t_start_ns", u64), ("t_end_ns", u64),
            ("bottleneck", pa.string()), ("trace_id", pa.string()), ("span_id", pa.string()),
            ("parent_span_id", pa.string()))},
    })
