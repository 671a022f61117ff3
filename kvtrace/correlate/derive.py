"""Offline correlation of a recorded dataset: the derived tables ``requests``, ``chunks``,
``steps`` and ``attributions`` (docs/schema.md), written beside the raw tables in the same
host/date partition as the run, and the spans of ``kvtrace export``.
"""
from __future__ import annotations

import contextlib
import gc
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.correlate.core import Result, correlate
from kvtrace.correlate.inputs import OVERLAP_PREFIXES, TABLES_USED
from kvtrace.correlate.requests import Acc, Requests, request_row, requests_table, trace_info
from kvtrace.dataset import schema
from kvtrace.errors import DatasetError

DERIVED = ("requests", "chunks", "steps", "attributions")


@dataclass
class RunInfo:
    run: str
    host: str
    date: str
    clock_offset_ns: int
    start_ns: int
    status: str


def _check_meta(path: Path) -> None:
    try:
        meta = json.loads((pq.read_schema(path).metadata or {}).get(schema.META_KEY, b"{}"))
    except Exception as e:
        raise DatasetError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    v = meta.get("schema_version")
    if v is not None and v != schema.SCHEMA_VERSION:
        raise DatasetError(f"{path} has schema version {v}; this kvtrace reads version {schema.SCHEMA_VERSION}")


def runs_of(root: Path) -> list[RunInfo]:
    out = []
    for path in sorted((root / "runs").rglob("*.parquet")):
        if path.name.startswith((".", "_")):
            continue
        _check_meta(path)
        parts = dict(p.split("=", 1) for p in path.relative_to(root).parts if "=" in p)
        for r in pq.read_table(path).to_pylist():
            out.append(RunInfo(r["run"], parts.get("host", ""), parts.get("date", ""), int(r["clock_offset_ns"] or 0),
                               int(r["start_ns"] or 0), r.get("status") or ""))
    return out


def load_run(root: Path, info: RunInfo) -> dict[str, pa.Table]:
    """The raw tables of one run on one host (files named after the run, in its host partition)."""
    tables: dict[str, pa.Table] = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        name = d.name
        if name in DERIVED or name == "runs" or not (name in TABLES_USED or name.startswith(OVERLAP_PREFIXES)):
            continue
        parts = []
        for path in sorted(d.glob(f"host={info.host}/date=*/{info.run}*.parquet")):
            if path.name.startswith((".", "_")) or not (path.stem == info.run or path.stem.startswith(info.run + "-p")):
                continue
            _check_meta(path)
            parts.append(pq.read_table(path).replace_schema_metadata(None))
        if parts:
            tables[name] = pa.concat_tables(parts, promote_options="default")
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


def correlate_run(root: Path, info: RunInfo, io_span_bytes: int = 1 << 20) -> RunCorrelation:
    with no_gc():
        res, accs, req_tbl, traces, rows = _correlate_tables(load_run(root, info), info.run, io_span_bytes)
    return RunCorrelation(info, res, req_tbl, accs, traces, rows)


def write_derived(root: Path, rc: RunCorrelation) -> dict[str, int]:
    """Write (or replace) the run's derived tables; returns rows per table."""
    from kvtrace import __version__
    from kvtrace.dataset.writer import _write

    out = {}
    tables = {"requests": rc.requests, "chunks": rc.result.chunks, "steps": rc.result.steps,
              "attributions": rc.result.attributions}
    for name, t in tables.items():
        t = t.cast(schema.TABLES[name]) if name in schema.TABLES else t
        t = schema.with_run(t, rc.info.run)
        path = root / name / f"host={rc.info.host}" / f"date={rc.info.date}" / f"{rc.info.run}.parquet"
        _write(t, path, {"schema_version": schema.SCHEMA_VERSION, "kvtrace_version": __version__,
                         "run": rc.info.run, "table": name})
        out[name] = t.num_rows
    return out


def correlate_dataset(root, run: str | None = None, write: bool = True) -> list[tuple[RunCorrelation, dict]]:
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"no dataset at {root}: give the --out directory of a kvtrace attach")
    infos = runs_of(root)
    if not infos:
        raise DatasetError(f"{root} holds no kvtrace runs (expected {root}/runs/host=*/date=*/*.parquet)")
    if run is not None:
        infos = [i for i in infos if i.run == run]
        if not infos:
            raise DatasetError(f"{root} has no run {run}")
    out = []
    for info in infos:
        rc = correlate_run(root, info)
        out.append((rc, write_derived(root, rc) if write else {}))
    return out
