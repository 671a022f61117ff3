"""KV transfers (kv_load, kv_store) go to the step whose window holds their start.  One naming
its request is exact_id to that request and to the request's chunk in that step; an unnamed one
(the hook's per-step connector record) is shared by the step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import EXACT, NONE, SHARED, Context, engine_map


@dataclass
class Transfers:
    tr: Cols            # kv_load rows then kv_store rows, with "dir" = "load" / "store"
    engine: np.ndarray  # per transfer: the engine its process belongs to
    step: np.ndarray    # step row holding its start, -1 if none
    cand: np.ndarray    # how many step windows held its start
    named: np.ndarray   # it names its request
    chunk: np.ndarray   # the named request's chunk in that step, -1 if none
    how: np.ndarray     # HOW code
    final: np.ndarray   # finalised by this pass
    n_load: int         # rows [0, n_load) are kv_load's

    @property
    def n(self) -> int:
        return self.tr.n


def kv_transfers(ctx: Context, chunks: Chunks) -> Transfers:
    cols, steps = ctx.cols, ctx.steps
    tr = {}
    for d, name in (("load", "kv_load"), ("store", "kv_store")):
        x = cols[name]
        for k, v in x.items():
            tr.setdefault(k, []).append(v)
        tr.setdefault("dir", []).append(np.full(x.n, d, dtype=object))
    tr = Cols({k: np.concatenate(v) for k, v in tr.items()})
    tr.n = len(tr["dir"])
    tr_engine = engine_map(tr["pid"], ctx.engines, cols["processes"])
    tr_step, tr_cand = ctx.index.locate(tr_engine, tr["t_start_ns"])
    tr_named = tr["request"] != ""
    tr_chunk = np.full(tr.n, -1, np.int64)
    for i in np.flatnonzero(tr_named & (tr_step >= 0)).tolist():
        s = int(tr_step[i])
        tr_chunk[i] = chunks.at.get((int(steps["pid"][s]), int(steps["step"][s]), tr["request"][i]), -1)
    tr_how = np.where(tr_named, EXACT, np.where(tr_step >= 0, SHARED, NONE))
    tr_final = ctx.final_of(tr_step, tr["t_start_ns"])
    return Transfers(tr, tr_engine, tr_step, tr_cand, tr_named, tr_chunk, tr_how, tr_final, cols["kv_load"].n)
