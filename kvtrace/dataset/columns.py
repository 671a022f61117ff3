"""The columns of a dataset file checked against what kvtrace writes (docs/schema.md, "Reading a
dataset"), from its footer when it is opened, before any command reads its rows:

- a column kvtrace writes as a number, text, flag or list that holds another kind of value;
- a key column (times, pids, steps, request ids) missing, or with a null;
- a hook table (vLLM's records: every field of every record is always sent) missing a field, or
  with a null in one;
- a negative value in a column kvtrace writes unsigned (times above all).

Each is a DatasetError (exit 6) naming the file, the table and the column.  Nulls and minima
come from the footer's statistics; a file written without them has those columns read.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvtrace.dataset import schema
from kvtrace.dataset.files import open_regular, shown
from kvtrace.errors import DatasetError

KEYS = ("pid", "engine_pid", "step", "request", "t_ns", "ts_ns", "t_start_ns", "t_end_ns")
RUN_KEYS = ("run", "start_ns", "stop_ns")
NULLABLE = {"attributions": ("engine_pid", "step", "request")}  # null: outside every step (docs/schema.md)


def declared(table: str) -> tuple[pa.Schema | None, bool]:
    """The schema kvtrace writes a table with, and whether it is a hook table (None: not known)."""
    if table == "runs":
        return schema.RUNS, False
    if table in schema.TABLES:
        return schema.TABLES[table], False
    if table in schema.V1_METRICS_TABLES:
        return schema.V1_METRICS, False
    hook = schema.hook_schema(table)
    return hook, hook is not None


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    for test, name in ((pa.types.is_integer, "integer"), (pa.types.is_floating, "number"),
                       (pa.types.is_string, "text"), (pa.types.is_large_string, "text"),
                       (pa.types.is_boolean, "flag"), (pa.types.is_null, "null")):
        if test(t):
            return name
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list of {_kind(t.value_type)}"
    return str(t)


def _fits(have: pa.DataType, want: pa.DataType) -> bool:
    h, w = _kind(have), _kind(want)
    return h == w or h == "null" or (w == "number" and h == "integer") or (w == "flag" and h == "integer")


def _keys(table: str, want: pa.Schema, hook: bool) -> list[str]:
    """The columns of table that must be present, without nulls."""
    if hook:
        return list(want.names)
    keys = RUN_KEYS if table == "runs" else KEYS
    return [k for k in keys if k in want.names and k not in NULLABLE.get(table, ())]


def _unsigned(want: pa.Schema) -> list[str]:
    return [f.name for f in want if pa.types.is_unsigned_integer(f.type)]


def bad(table: str, column: str, path: Path, what: str) -> DatasetError:
    return DatasetError(f"table {table}, column {column}: {what} in {shown(path)} (changed, or not written by "
                        "kvtrace: move it out of the dataset)")


def check(table: str, path: Path, have: pa.Schema, md: pq.FileMetaData) -> None:
    """DatasetError when the file's columns are not what kvtrace writes for table (module docstring)."""
    want, hook = declared(table)
    if want is None:
        return
    for f in have:
        if f.name in want.names and not _fits(f.type, want.field(f.name).type):
            raise bad(table, f.name, path, f"{_kind(f.type)} ({f.type}) where kvtrace writes "
                                           f"{_kind(want.field(f.name).type)} ({want.field(f.name).type})")
    keys = _keys(table, want, hook)
    missing = [k for k in keys if k not in have.names]
    if missing:
        more = f" (and {', '.join(missing[1:])})" if missing[1:] else ""
        raise bad(table, missing[0], path, f"missing{more}")
    signed = [c for c in _unsigned(want) if c in have.names and pa.types.is_signed_integer(have.field(c).type)]
    _check_values(table, path, md, [k for k in keys if _flat(have, k)], [c for c in signed if _flat(have, c)])


def _flat(have: pa.Schema, name: str) -> bool:
    t = have.field(name).type
    return not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_struct(t))


def _check_values(table: str, path: Path, md: pq.FileMetaData, nonnull: list[str], nonneg: list[str]) -> None:
    nulls, low, unknown = _stats(md, set(nonnull) | set(nonneg), set(nonneg))
    if unknown:
        nulls, low = _read_stats(path, unknown, nulls, low)
    for c in nonnull:
        if nulls.get(c):
            raise bad(table, c, path, f"{nulls[c]:,} null value{'s' if nulls[c] > 1 else ''} "
                                      "(kvtrace writes one in every row)")
    for c in nonneg:
        if low.get(c) is not None and low[c] < 0:
            raise bad(table, c, path, f"negative values (down to {low[c]}) where kvtrace writes it unsigned")


def _stats(md: pq.FileMetaData, cols: set[str], signed: set[str]) -> tuple[dict, dict, set]:
    """Nulls and minimum (of the signed columns) per column from the row groups' statistics; the
    columns without them."""
    nulls: dict[str, int] = {}
    low: dict[str, int] = {}
    unknown: set[str] = set()
    at = {j: md.schema.column(j).path for j in range(md.num_columns) if md.schema.column(j).path in cols}
    for g in range(md.num_row_groups):
        for j, name in at.items():
            st = md.row_group(g).column(j).statistics
            if st is None or not st.has_null_count or (name in signed and st.num_values and not st.has_min_max):
                unknown.add(name)
                continue
            nulls[name] = nulls.get(name, 0) + st.null_count
            if name in signed and st.has_min_max:
                low[name] = min(low.get(name, st.min), st.min)
    return nulls, low, unknown


def _read_stats(path: Path, cols: set[str], nulls: dict, low: dict) -> tuple[dict, dict]:
    """Nulls and minimum of cols read from the file (it has no statistics for them)."""
    with open_regular(path) as f:
        t = pq.read_table(f, columns=sorted(cols))
    for c in cols:
        nulls[c] = t[c].null_count
        if pa.types.is_integer(t[c].type) and t.num_rows > t[c].null_count:
            low[c] = pc.min(t[c]).as_py()
    return nulls, low
