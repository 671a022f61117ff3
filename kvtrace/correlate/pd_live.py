"""Prefill/decode pairs while attached (one capture of both servers, `attach --port P --port D
--otlp URL`): the decode request's spans join its prefill request's trace as `kvtrace export`
makes them (kvtrace.correlate.pd, the same rules: a shared request id, else the prompt).  The
prefill side finishes before the decode side is admitted, so each decode request is paired when
its kv_alloc comes, against the prefill requests seen so far (bounded: the newest MAX kept)."""
from __future__ import annotations

from collections import OrderedDict

import pyarrow as pa

from kvtrace.correlate import ids
from kvtrace.correlate.pd import prompt_key, traceparent_of

MAX = 4096


class LivePairs:
    def __init__(self, run: str):
        self.run = run
        self.keys: OrderedDict = OrderedDict()       # (pid, request) -> prompt key
        self.tp: OrderedDict = OrderedDict()         # (pid, request) -> its own traceparent
        self.prefill: OrderedDict = OrderedDict()    # (pid, request) -> key, in finish order
        self.handed: OrderedDict = OrderedDict()     # decode request -> traceparent handed to it
        self.paired = 0

    def feed(self, tables: dict[str, pa.Table]) -> dict[str, str]:
        """Take one flush's records; the decode requests paired by it -> their traceparent."""
        for r in _rows(tables, "prompt_blocks"):
            k = prompt_key(r)
            if k is not None:
                _put(self.keys, (r["pid"], r["request"]), k)
        for r in _rows(tables, "arrive"):
            _put(self.tp, (r["pid"], r["request"]), r["traceparent"] or "")
        for r in _rows(tables, "kv_finish"):
            k = self.keys.get((r["pid"], r["request"]))
            if r["blocks"] and k is not None:
                _put(self.prefill, (r["pid"], r["request"]), k)
        new = {}
        for r in _rows(tables, "kv_alloc"):
            d = (r["pid"], r["request"])
            k = self.keys.get(d)
            if not r["external"] or k is None or r["request"] in self.handed or self.tp.get(d):
                continue
            p = self._match(d, k)
            if p is None:
                continue
            del self.prefill[p]
            new[r["request"]] = traceparent_of(self.run, p[1], self.tp.get(p, ""))
            _put(self.handed, r["request"], new[r["request"]])
            self.paired += 1
        return new

    def _match(self, d: tuple, k: tuple):
        ext = ids.external_id(d[1])
        cands = [p for p, pk in self.prefill.items() if pk == k and p[0] != d[0]]
        return next((p for p in cands if ids.external_id(p[1]) == ext), cands[0] if cands else None)


def handed_arrive(t: pa.Table, handed: dict[str, str]) -> pa.Table:
    """The arrive rows with the handed traceparent where they carry none."""
    tp = [x or handed.get(r, "") for r, x in zip(t["request"].to_pylist(), t["traceparent"].to_pylist())]
    i = t.schema.get_field_index("traceparent")
    return t.set_column(i, t.schema.field(i), pa.array(tp, t.schema.field(i).type))


def _rows(tables, name: str) -> list[dict]:
    t = tables.get(name)
    return t.to_pylist() if t is not None and t.num_rows else []


def _put(d: OrderedDict, k, v) -> None:
    d[k] = v
    d.move_to_end(k)
    while len(d) > MAX:
        d.popitem(last=False)
