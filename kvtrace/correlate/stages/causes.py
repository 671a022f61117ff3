"""Miss causes: the pass's final steps fed to the prefix-cache replay (kvtrace.correlate.causes),
which gives every token of every admission of those steps its cause.

The replay's structure tables (each request's block-hash chain, its chain without extra keys,
the lookups that differ from plain, the cache at attach) are consumed whole each pass; the step
records only once their step is final, in step order."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.correlate.causes import MISSES, CacheReplay, Segment
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import Context
from kvtrace.correlate.stages.evictions import Evictions, Preemptions
from kvtrace.correlate.inputs import STRUCTURE


def cache_causes(ctx: Context, chunks: Chunks, ev: Evictions, pr: Preemptions, finish_final: np.ndarray,
                 replay: CacheReplay) -> list[Segment]:
    replay.structure(**{name: _rows(ctx.tables.get(name)) for name in STRUCTURE})
    st = ctx.steps
    for pid in ctx.engines:   # a dataset from a hook without snapshots: fresh when its first step is vLLM's first
        mine = st["step"][st["pid"] == pid]
        replay.set_fresh(pid, bool(len(mine)) and int(mine.min()) == 1)
    fin = ctx.final
    steps = [{"pid": int(st["pid"][i]), "step": int(st["step"][i]), "t_start_ns": int(st["t_start_ns"][i])}
             for i in np.flatnonzero(fin).tolist()]
    return replay.feed(steps, _final(chunks.admit, chunks.admit_final), _final(chunks.ch, chunks.final),
                       _final(ev.ev, ev.final), _final(pr.pr, pr.final), _final(ctx.cols["finish"], finish_final))


def with_chunk_causes(table: pa.Table, replay: CacheReplay) -> pa.Table:
    """The chunks table with each chunk's computed tokens by miss cause (columns miss_*)."""
    cols = {k: [] for k in MISSES}
    keys = zip(*(table[k].to_pylist() for k in ("engine_pid", "request", "attempt", "token_start", "token_end")))
    for pid, r, attempt, a, b in keys:
        for k, v in replay.chunk_causes(pid, r, attempt, a, b).items():
            cols[k].append(v)
    for k in MISSES:
        table = table.append_column(k, pa.array(cols[k], pa.uint32()))
    return table


def _rows(t: pa.Table | None) -> list[dict]:
    return [] if t is None or t.num_rows == 0 else t.to_pylist()


def _final(cols, mask: np.ndarray) -> list[dict]:
    idx = np.flatnonzero(mask).tolist()
    out = [{} for _ in idx]
    for k, v in cols.items():
        vals = v[idx].tolist()
        for d, x in zip(out, vals):
            d[k] = x
    return out
