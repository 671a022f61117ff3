"""Run the DuckDB queries of examples/queries/ on a kvtrace dataset.

    python examples/query.py DIR                 list the queries
    python examples/query.py DIR QUERY [--limit N] [--csv]

DIR is the --out directory of `kvtrace attach`.  Each .sql file reads the Parquet files with
paths relative to DIR (`read_parquet('chunks/*/*/*.parquet', hive_partitioning = true)`), so it
also runs as is in the DuckDB shell from DIR: `cd DIR && duckdb -f .../queries/requests.sql`.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import duckdb

QUERIES = Path(__file__).resolve().parent / "queries"
SCHEMA_VERSIONS = {1, 2}  # docs/schema.md: the derived tables these queries read are the same in both
DERIVED = ("requests", "chunks", "steps", "attributions")


def queries() -> dict[str, str]:
    """Query name -> its first comment line."""
    return {p.stem: p.read_text().splitlines()[0].lstrip("- ") for p in sorted(QUERIES.glob("*.sql"))}


def connect(dataset) -> duckdb.DuckDBPyConnection:
    """A connection whose relative paths are the dataset's, after checking its schema version."""
    root = Path(dataset).resolve()
    if not (root / "runs").is_dir():
        raise SystemExit(f"{dataset}: not a kvtrace dataset (no runs/ table): give the --out directory of kvtrace attach")
    con = duckdb.connect()
    con.execute(f"SET file_search_path = '{str(root).replace(chr(39), chr(39) * 2)}'")
    versions = {v for (v,) in con.sql("SELECT DISTINCT schema_version FROM read_parquet('runs/*/*/*.parquet')").fetchall()}
    if not versions <= SCHEMA_VERSIONS:
        raise SystemExit(f"{dataset}: schema version {sorted(versions)}; these queries read versions 1 and 2")
    return con


def run(dataset, name: str) -> tuple[list[str], list[tuple]]:
    """Column names and rows of one query on the dataset."""
    path = QUERIES / f"{name}.sql"
    if not path.is_file():
        raise SystemExit(f"no query {name!r}; the queries: {', '.join(queries())}")
    con = connect(dataset)
    try:
        rel = con.sql(path.read_text())
    except duckdb.IOException as e:
        missing = re.search(r"[\"']([a-z_]+)/\*/\*/\*\.parquet[\"']", str(e))
        if not missing:
            raise
        table = missing.group(1)
        hint = (f"run `kvtrace correlate {dataset}` to add the derived tables" if table in DERIVED
                else "the capture recorded none of these (docs/schema.md says which probe or hook record writes it)")
        raise SystemExit(f"{dataset} has no {table} table: {hint}") from None
    return rel.columns, rel.fetchall()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset")
    ap.add_argument("query", nargs="?")
    ap.add_argument("--limit", type=int, default=20, help="rows to print (default 20; 0: all)")
    ap.add_argument("--csv", action="store_true", help="print every row as CSV")
    a = ap.parse_args(argv)
    if a.query is None:
        connect(a.dataset)
        for name, what in queries().items():
            print(f"{name:22} {what}")
        return
    cols, rows = run(a.dataset, a.query)
    if a.csv:
        import csv
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        w.writerows(rows)
        return
    shown = rows if a.limit <= 0 else rows[:a.limit]
    cells = [cols] + [["" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in r] for r in shown]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    if len(rows) > len(shown):
        print(f"({len(rows) - len(shown)} more rows: --limit 0 shows all)")


if __name__ == "__main__":
    main()
