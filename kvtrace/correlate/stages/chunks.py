"""Chunks and admissions name their step and request (exact_id): the index the later stages
look chunks up in, and which of them this pass finalises."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.context import Context


@dataclass
class Chunks:
    ch: Cols                                # the chunk records
    at: dict[tuple[int, int, str], int]     # (engine pid, step, request) -> chunk row
    step: np.ndarray                        # per chunk: its step row, -1 if the step record is absent
    final: np.ndarray                       # per chunk: finalised by this pass
    admit: Cols                             # the admit records
    admit_of: dict[tuple[int, str, int], int]  # (engine pid, request, attempt) -> admit row
    admit_final: np.ndarray

    def rows(self, pid: np.ndarray, step: np.ndarray, request: np.ndarray) -> np.ndarray:
        """The chunk row of each (engine pid, step, request), -1 if that request had no chunk there."""
        at = self.at
        return np.array([at.get((p, s, r), -1) for p, s, r in zip(pid.tolist(), step.tolist(), request.tolist())],
                        np.int64)


def index_chunks(ctx: Context) -> Chunks:
    ch, ad = ctx.cols["chunk"], ctx.cols["admit"]
    at: dict[tuple[int, int, str], int] = {}
    for i, key in enumerate(zip(ch["pid"].tolist(), ch["step"].tolist(), ch["request"].tolist())):
        at[key] = i
    ch_step = ctx.index.rows(ch["pid"], ch["step"])
    admit_of = {k: i for i, k in enumerate(zip(ad["pid"].tolist(), ad["request"].tolist(), ad["attempt"].tolist()))}
    # chunk and admit records are final with their step; without one, at once (time 0)
    ch_final = ctx.final_of(ch_step, np.zeros(ch.n, np.uint64))
    ad_final = ctx.final_of(ctx.index.rows(ad["pid"], ad["step"]), np.zeros(ad.n, np.uint64))
    return Chunks(ch, at, ch_step, ch_final, ad, admit_of, ad_final)
