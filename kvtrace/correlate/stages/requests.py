"""Requests: the trace id of each request (its arrive record's W3C traceparent, else one derived
from run and request id), and the request-level records a pass hands to
kvtrace.correlate.requests (admissions, arrivals, finishes, and the connector's loads: kv_alloc
and kv_done rows, each taken once, when it comes)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.correlate import ids
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import Context


class Traces:
    """(trace id, parent span, joined) per request: from the arrive records (a record with a
    traceparent wins over one without), else derived from the run and the request id on first use."""

    def __init__(self, run: str, by: dict):
        self.run = run
        self.by = by

    def of(self, request: str):
        t = self.by.get(request)
        if t is None:
            t = self.by[request] = ids.trace_of(self.run, request, "")
        return t


def trace_ids(ctx: Context) -> Traces:
    ar = ctx.cols["arrive"]
    by = {}
    for r, tp in zip(ar["request"].tolist(), ar["traceparent"].tolist()):
        if r not in by or tp:
            by[r] = ids.trace_of(ctx.run, r, tp)
    return Traces(ctx.run, by)


@dataclass
class RequestRecords:
    admits: list[dict]      # final admissions
    arrives: list[dict]     # every arrive row seen (not only final ones)
    finishes: list[dict]    # final finish records
    finish_final: np.ndarray
    connector: list[dict]   # kv_alloc and kv_done rows ("what": "alloc" / "done")


def request_records(ctx: Context, chunks: Chunks) -> RequestRecords:
    ad = chunks.admit
    admits = [{k: (ad[k][i] if k == "request" else int(ad[k][i])) for k in ad}
              for i in np.flatnonzero(chunks.admit_final).tolist()]
    ar = ctx.cols["arrive"]
    arrives = [{"engine_pid": int(ar["pid"][i]), "request": ar["request"][i], "t_ns": int(ar["t_ns"][i]),
                "traceparent": ar["traceparent"][i], "tracestate": ar["tracestate"][i]} for i in range(ar.n)]
    fi = ctx.cols["finish"]
    fi_final = ctx.final_of(ctx.index.rows(fi["pid"], fi["step"]), fi["t_ns"])
    finishes = [{"engine_pid": int(fi["pid"][i]), "request": fi["request"][i], "t_ns": int(fi["t_ns"][i])}
                for i in np.flatnonzero(fi_final).tolist()]
    return RequestRecords(admits, arrives, finishes, fi_final, connector_records(ctx))


def connector_records(ctx: Context) -> list[dict]:
    al, dn = ctx.cols["kv_alloc"], ctx.cols["kv_done"]
    out = [{"what": "alloc", "engine_pid": int(al["pid"][i]), "request": al["request"][i], "t_ns": int(al["t_ns"][i]),
            "external": int(al["external"][i]), "nbytes": int(al["nbytes"][i]), "async": int(al["async"][i]),
            "connector": al["connector"][i]} for i in range(al.n)]
    out += [{"what": "done", "engine_pid": int(dn["pid"][i]), "request": dn["request"][i], "t_ns": int(dn["t_ns"][i]),
             "direction": dn["direction"][i], "ok": int(dn["ok"][i])} for i in range(dn.n)]
    return out
