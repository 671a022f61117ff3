"""Offline correlation of a recorded dataset: the derived tables ``requests``, ``chunks``,
``steps`` and ``attributions`` (docs/schema.md), written beside the raw tables in the same
host/date partition as the run, and the spans of ``kvtrace export``.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from kvtrace.correlate import pd
from kvtrace.correlate.pd_live import handed_arrive
from kvtrace.correlate.causes import table_rows
from kvtrace.correlate.core import Result, correlate
from kvtrace.correlate.inputs import OVERLAP_PREFIXES, TABLES_USED
from kvtrace.correlate.requests import Acc, Requests, request_row, requests_table, trace_info
from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset
from kvtrace.errors import DatasetError, UsageError
from kvtrace import __version__
from kvtrace.dataset.writer import _write

DERIVED = ("requests", "chunks", "steps", "attributions", "token_causes")
HOOK_NEEDED = ("step", "chunk", "admit")  # vLLM's records without which there is nothing to derive


@dataclass
class RunInfo:
    run: str
    host: str
    date: str
    clock_offset_ns: int
    start_ns: int
    status: str


def _open(root) -> Dataset:
    return root if isinstance(root, Dataset) else Dataset.open(root)


def runs_of(root) -> list[RunInfo]:
    """The runs of a dataset (a Dataset or its directory), from its runs table."""
    return [RunInfo(r["run"], r.get("host") or "", r.get("date") or "", int(r["clock_offset_ns"] or 0),
                    int(r["start_ns"] or 0), r.get("status") or "") for r in _open(root).table("runs").to_pylist()]


def load_run(root, info: RunInfo) -> dict[str, pa.Table]:
    """The raw tables of one run on one host (files named after the run, in its host partition)."""
    ds = _open(root)
    tables: dict[str, pa.Table] = {}
    for name in ds.names():
        if name in DERIVED or not (name in TABLES_USED or name.startswith(OVERLAP_PREFIXES)):
            continue
        t = ds.table(name, run=info.run, host=info.host, partitions=False)
        if t.num_rows:  # an absent table reads as no rows (kvtrace.correlate.inputs)
            tables[name] = t
    return tables


@dataclass
class RunCorrelation:
    info: RunInfo
    result: Result
    requests: pa.Table
    accs: list[Acc]
    traces: dict
    rows: list[dict]  # request_row of each of accs, in that order


@contextlib.contextmanager
def no_gc():
    """The cyclic collector off for a pass that allocates many small objects and frees them all
    at the end (a full collection would walk every live row dict for nothing)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def correlate_tables(tables: dict[str, pa.Table], run: str, io_span_bytes: int = 1 << 20):
    """(Result, closed request accumulators, requests table, trace info per request)."""
    with no_gc():
        return _correlate_tables(tables, run, io_span_bytes)[:4]


def _correlate_tables(tables: dict[str, pa.Table], run: str, io_span_bytes: int = 1 << 20):
    res = correlate(tables, run, io_span_bytes=io_span_bytes)
    reqs = Requests(run)
    reqs.add(res)
    traces = {r: trace_info(run, r, a) for r, a in reqs.open.items()}
    accs = reqs.close(None)
    rows = [request_row(run, a) for a in accs]
    return res, accs, requests_table(run, accs, rows), traces, rows


def correlate_run(root, info: RunInfo, io_span_bytes: int = 1 << 20, handed: dict | None = None) -> RunCorrelation:
    """handed: {request: traceparent} for the run's decode requests of prefill/decode pairs
    (kvtrace.correlate.pd.handoffs): their spans join the prefill request's trace."""
    tables = load_run(root, info)
    if handed and "arrive" in tables:
        tables["arrive"] = handed_arrive(tables["arrive"], handed)
    with no_gc():
        res, accs, req_tbl, traces, rows = _correlate_tables(tables, info.run, io_span_bytes)
    return RunCorrelation(info, res, req_tbl, accs, traces, rows)




def derived_tables(rc: RunCorrelation) -> dict[str, pa.Table]:
    causes = pa.Table.from_pydict(table_rows(rc.result.segments), schema=schema.TABLES["token_causes"])
    return {"requests": rc.requests, "chunks": rc.result.chunks, "steps": rc.result.steps,
            "attributions": rc.result.attributions, "token_causes": causes}


ON_FULL = "kvtrace correlate stopped; the raw tables are untouched (run kvtrace correlate again once there is space)"


def write_derived(root, rc: RunCorrelation) -> dict[str, int]:
    """Write (or replace) the run's derived tables; returns rows per table."""

    root = root.root if isinstance(root, Dataset) else Path(root)
    out = {}
    for name, t in derived_tables(rc).items():
        t = t.cast(schema.TABLES[name]) if name in schema.TABLES else t
        t = schema.with_run(t, rc.info.run)
        path = root / name / f"host={rc.info.host}" / f"date={rc.info.date}" / f"{rc.info.run}.parquet"
        _write(t, path, {"schema_version": schema.SCHEMA_VERSION, "kvtrace_version": __version__,
                         "run": rc.info.run, "table": name}, on_full=ON_FULL)
        out[name] = t.num_rows
    return out


def shrinking(ds: Dataset, rc: RunCorrelation) -> dict[str, tuple[int, int]]:
    """Derived tables of the run that would be replaced by fewer rows: name -> (rows now, rows new)."""
    i = rc.info
    now = {name: ds.rows(name, run=i.run, host=i.host) for name in DERIVED}
    new = {name: t.num_rows for name, t in derived_tables(rc).items()}
    return {name: (now[name], new[name]) for name in DERIVED if new[name] < now[name]}


def _fewer_text(rc: RunCorrelation, fewer: dict[str, tuple[int, int]], ds: Dataset) -> str:
    i = rc.info
    lacking = [t for t in HOOK_NEEDED if not ds.files(t, run=i.run, host=i.host)]
    torn = [s.path for s in ds.skipped if s.table not in DERIVED]
    why = [f"no readable {', '.join(lacking)} records of the run"] if lacking else []
    why += [f"unreadable, left out: {torn[0]}" + (f" and {len(torn) - 1} more files" if len(torn) > 1 else "")] if torn else []
    counts = ", ".join(f"{n} {a} -> {b}" for n, (a, b) in fewer.items())
    return f"the derived tables of run {i.run} ({i.host}) by fewer rows: {counts}" + (f" ({'; '.join(why)})" if why else "")


def check_shrinking(ds: Dataset, done: list[RunCorrelation], force: bool) -> None:
    """Refuse (before anything is written) to replace derived tables by fewer rows; with force,
    say that it is done."""
    for rc in done:
        fewer = shrinking(ds, rc)
        if fewer and not force:
            raise UsageError(f"not replacing {_fewer_text(rc, fewer, ds)}; nothing written "
                             "(give --force to replace them)")
        if fewer:
            ds.say(f"--force: replacing {_fewer_text(rc, fewer, ds)}")


def correlate_dataset(root, run: str | None = None, write: bool = True,
                      force: bool = False) -> list[tuple[RunCorrelation, dict]]:
    """Correlate every run (or one) and, with write, replace its derived tables; refuses
    (UsageError, exit 2) to replace one by fewer rows unless force."""
    ds = root if isinstance(root, Dataset) else Dataset.open(root, defer=True)
    infos = runs_of(ds)
    if not infos:
        raise DatasetError(f"{ds.root} holds no kvtrace runs (expected {ds.root}/runs/host=*/date=*/*.parquet)")
    if run is not None:
        infos = [i for i in infos if i.run == run]
        if not infos:
            raise DatasetError(f"{ds.root} has no run {run}")
    every = runs_of(ds)
    found = pd.pairs(ds, every)
    handed = pd.handoffs(found)
    done = [correlate_run(ds, info, handed=handed.get((info.run, info.host))) for info in infos]
    if write:
        check_shrinking(ds, done, force)
    ds.go_on()
    if not write:
        return [(rc, {}) for rc in done]
    out = [(rc, write_derived(ds, rc)) for rc in done]
    if found:   # only the partitions of the runs correlated here: another agent's stay its own
        write_handovers(ds, every, found, done, {(i.run, i.host) for i in infos})
    return out


def write_handovers(ds: Dataset, every: list[RunInfo], found: list, done: list[RunCorrelation],
                    mine: set[tuple[str, str]]) -> None:
    """The prefill/decode pairs' handovers table, in the partition of each decode run of ``mine``
    (both sides' requests rows: this pass's, else the derived table already written)."""
    offsets = {(i.run, i.host): i.clock_offset_ns for i in every}
    shifts = pd.align(found, offsets)
    pd.transport(ds, every, found)
    fresh = {(rc.info.run, rc.info.host): rc.requests for rc in done}
    reqs = {}
    involved = {(s.run, s.host) for x in found for s in (x.p, x.d)}
    for i in every:
        if (i.run, i.host) not in involved:
            continue
        t = fresh.get((i.run, i.host))
        t = t if t is not None else ds.table("requests", run=i.run, host=i.host, partitions=False)
        reqs[(i.run, i.host)] = {(r["engine_pid"], r["request"]): r for r in t.select(
            [c for c in ("engine_pid", "request", "arrival_ns", "first_scheduled_ns", "prefill_end_ns")
             if c in t.column_names]).to_pylist()}
    by = {(i.run, i.host): i for i in every}
    for key, rows in pd.rows(found, shifts, offsets, reqs).items():
        if key not in mine:
            continue
        info = by[key]
        t = schema.with_run(pa.Table.from_pylist(rows, schema=schema.TABLES["handovers"]), info.run)
        path = ds.root / "handovers" / f"host={info.host}" / f"date={info.date}" / f"{info.run}.parquet"
        _write(t, path, {"schema_version": schema.SCHEMA_VERSION, "kvtrace_version": __version__,
                         "run": info.run, "table": "handovers"}, on_full=ON_FULL)
