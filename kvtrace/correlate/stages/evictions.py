"""Evictions and preemptions name their step and request (exact_id).  An eviction goes to the
chunk of the request whose allocation evicted the block (one outside any allocation names no
request: shared); a preemption to the chunk of the request whose allocation failed."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import Context


@dataclass
class Evictions:
    ev: Cols
    step: np.ndarray    # step row, -1 if the step record is absent
    chunk: np.ndarray   # the evicting request's chunk in that step, -1 if none
    final: np.ndarray


@dataclass
class Preemptions:
    pr: Cols
    step: np.ndarray
    for_chunk: np.ndarray  # the chunk of the request whose allocation preempted (for_request)
    chunk: np.ndarray      # the preempted request's own chunk in that step
    final: np.ndarray


def evictions(ctx: Context, chunks: Chunks) -> Evictions:
    ev = ctx.cols["evict"]
    step = ctx.index.rows(ev["pid"], ev["step"])
    return Evictions(ev, step, chunks.rows(ev["pid"], ev["step"], ev["request"]), ctx.final_of(step, ev["t_ns"]))


def preemptions(ctx: Context, chunks: Chunks) -> Preemptions:
    pr = ctx.cols["preempt"]
    step = ctx.index.rows(pr["pid"], pr["step"])
    return Preemptions(pr, step, chunks.rows(pr["pid"], pr["step"], pr["for_request"]),
                       chunks.rows(pr["pid"], pr["step"], pr["request"]), ctx.final_of(step, pr["t_ns"]))


def _chunk_key(ch: Cols, j: int):
    return (int(ch["attempt"][j]), int(ch["step"][j])) if j >= 0 else None


def evict_records(ev: Evictions, chunks: Chunks) -> list[dict]:
    """The final evictions, for the request accumulators and span events."""
    x, ch = ev.ev, chunks.ch
    return [{"engine_pid": int(x["pid"][i]), "step": int(x["step"][i]), "t_ns": int(x["t_ns"][i]),
             "block_hash": int(x["block_hash"][i]), "group": int(x["group"][i]), "block_id": int(x["block_id"][i]),
             "medium": x["medium"][i], "request": x["request"][i], "chunk": _chunk_key(ch, ev.chunk[i])}
            for i in np.flatnonzero(ev.final).tolist()]


def preempt_records(pr: Preemptions, chunks: Chunks) -> list[dict]:
    x, ch = pr.pr, chunks.ch
    return [{"engine_pid": int(x["pid"][i]), "step": int(x["step"][i]), "t_ns": int(x["t_ns"][i]),
             "request": x["request"][i], "computed_before": int(x["computed_before"][i]),
             "num_tokens": int(x["num_tokens"][i]), "num_preemptions": int(x["num_preemptions"][i]),
             "for_request": x["for_request"][i], "for_chunk": _chunk_key(ch, pr.for_chunk[i])}
            for i in np.flatnonzero(pr.final).tolist()]
