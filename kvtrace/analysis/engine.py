"""One SQL text, two engines: DuckDB (default, in process) and Apache Spark (pyspark).

Each table becomes a view with the analysis' column names and types (BIGINT integers, DOUBLE,
text; 64-bit hashes stay unsigned: UBIGINT in DuckDB, DECIMAL(20,0) in Spark).  A table the
dataset lacks becomes an empty view with the same columns, so every query runs.  The tables
kvtrace.analysis.load builds (server_metrics) are given to the engine as Arrow tables, the rest
are read from their files.  Results come back as plain Python values (Decimal -> int), so the
two engines' reports compare equal.
"""
from __future__ import annotations

import decimal
import os
import re
import threading

import pyarrow as pa
from pathlib import Path

from kvtrace.analysis.load import BUILT, COLUMNS, Inputs
from kvtrace.errors import UsageError


def _py(v):
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    return v


class Engine:
    name = "?"
    types = {"I": "BIGINT", "F": "DOUBLE", "S": "VARCHAR"}
    temp = "TEMP "      # views and tables the analysis makes live only as long as the session
    workers = 1         # figures run at once (threads, each with its own connection)

    def q(self, col: str) -> str:
        raise NotImplementedError

    def read(self, view: str, files: list[Path]) -> None:
        raise NotImplementedError

    def load(self, view: str, table: pa.Table) -> None:
        """An Arrow table as view (string, integer and double columns)."""
        raise NotImplementedError

    def execute(self, sql: str) -> None:
        raise NotImplementedError

    def rows(self, sql: str) -> list[dict]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def create(self, name: str, sql: str) -> None:
        """A derived table the figures read (materialized once: several figures share it)."""
        self.execute(f"CREATE OR REPLACE {self.temp}VIEW {name} AS {sql}")

    def view(self, name: str, sql: str) -> None:
        """A derived table left as a view: computed again by each query that reads it."""
        self.execute(f"CREATE OR REPLACE {self.temp}VIEW {name} AS {sql}")

    def null(self, kind: str) -> str:
        return f"CAST(NULL AS {self.types[kind]})"

    def _raw(self, table: str, inp: Inputs) -> set[str]:
        """raw_<table> made from the table's files (or from what load built), its columns; none
        when the dataset has no rows of it."""
        if table in BUILT:
            t = BUILT[table](inp)
            if t.num_rows:
                self.load(f"raw_{table}", t)
            return set(t.column_names) if t.num_rows else set()
        files = inp.files.get(table, [])
        if files:
            self.read(f"raw_{table}", files)
        return inp.present.get(table, set()) if files else set()

    def register(self, inp: Inputs) -> None:
        for table, cols in COLUMNS.items():
            have = self._raw(table, inp)
            exprs = [f"COALESCE(CAST({self.q('run')} AS {self.types['S']}), '') AS run" if "run" in have else "'' AS run"]
            for src, alias, kind in cols:
                if src not in have:
                    exprs.append(f"{self.null(kind)} AS {alias}")
                elif kind in ("H", "HL"):
                    exprs.append(f"{self.q(src)} AS {alias}")
                else:
                    exprs.append(f"CAST({self.q(src)} AS {self.types[kind]}) AS {alias}")
            if have:
                self.execute(f"CREATE OR REPLACE {self.temp}VIEW {table} AS SELECT {', '.join(exprs)} FROM raw_{table}")
            else:
                self.execute(f"CREATE OR REPLACE {self.temp}VIEW {table} AS SELECT {', '.join(exprs)} FROM {self.one_row()} WHERE 1 = 0")
        self.execute(self.explode_sql())

    def one_row(self) -> str:
        return "(SELECT 1 AS x) t0"

    def explode_sql(self) -> str:
        raise NotImplementedError


# percentile_disc(p) WITHIN GROUP (ORDER BY x), x ascending (an expression without parentheses)
_PCT = re.compile(r"percentile_disc\(([0-9.]+)\) WITHIN GROUP \(ORDER BY ((?:(?!\s(?:ASC|DESC)\b)[^()])+?)\)", re.I)


def _shared_quantiles(sql: str) -> str:
    """percentile_disc(p) WITHIN GROUP (ORDER BY x), as DuckDB runs it (quantile_disc), with every
    percentile of one x in the text taken from one list: DuckDB computes identical aggregates once,
    so the values of x are gathered and selected in one state instead of one state per p."""
    ps: dict[str, list[str]] = {}
    for p, x in _PCT.findall(sql):
        if p not in ps.setdefault(x, []):
            ps[x].append(p)

    def one(m):
        p, x = m.group(1), m.group(2)
        if len(ps[x]) == 1:
            return f"quantile_disc({x}, {p})"
        return f"quantile_disc({x}, [{', '.join(ps[x])}])[{ps[x].index(p) + 1}]"
    return _PCT.sub(one, sql)


class DuckDBEngine(Engine):
    name = "duckdb"
    types = {"I": "BIGINT", "F": "DOUBLE", "S": "VARCHAR", "H": "UBIGINT", "HL": "UBIGINT[]"}
    # The database is this process' own (in memory), so its views and tables need not be TEMP:
    # that lets the worker connections see them.  Two workers: the kernel tables' figures run
    # while the hook tables' views are built, and one figure's rows become Python objects while
    # another query runs.
    temp = ""

    def __init__(self, threads: int | None = None):
        import duckdb

        self.con = duckdb.connect(":memory:")
        self.con.execute("SET enable_progress_bar = false")
        if threads:
            self.con.execute(f"SET threads = {int(threads)}")
        self.workers = 2
        self._local = threading.local()
        self._lock = threading.Lock()
        # the workers' connections, made here (not while the main connection runs a query)
        self._cursors: list = [self.con.cursor() for _ in range(self.workers)]
        self._spare = list(self._cursors)

    def _con(self):
        """The calling thread's connection (a worker thread gets a cursor of its own on the database)."""
        if threading.current_thread() is threading.main_thread():
            return self.con
        c = getattr(self._local, "con", None)
        if c is None:
            with self._lock:
                if self._spare:
                    c = self._spare.pop()
                else:
                    c = self.con.cursor()
                    self._cursors.append(c)
            self._local.con = c
        return c

    def q(self, col: str) -> str:
        return '"' + col.replace('"', '""') + '"'

    def read(self, view: str, files: list[Path]) -> None:
        lst = ", ".join("'" + str(p).replace("'", "''") + "'" for p in files)
        self.con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM read_parquet([{lst}], union_by_name = true)")

    def load(self, view: str, table: pa.Table) -> None:
        self.con.register("kvtrace_arrow", table)
        try:
            self.con.execute(f"CREATE OR REPLACE TABLE {view} AS SELECT * FROM kvtrace_arrow")
        finally:
            self.con.unregister("kvtrace_arrow")

    def execute(self, sql: str) -> None:
        self.con.execute(sql)

    def create(self, name: str, sql: str) -> None:
        self.con.execute(f"CREATE OR REPLACE TABLE {name} AS {_shared_quantiles(sql)}")

    def rows(self, sql: str) -> list[dict]:
        t = self._con().sql(_shared_quantiles(sql)).to_arrow_table()
        if any(pa.types.is_decimal(f.type) for f in t.schema):  # SUM of BIGINT is HUGEINT: back to int64
            t = t.cast(pa.schema([pa.field(f.name, (pa.int64() if f.type.scale == 0 else pa.float64())
                                           if pa.types.is_decimal(f.type) else f.type) for f in t.schema]))
        return t.to_pylist()

    def explode_sql(self) -> str:
        # The same rows as the generic DISTINCT over every exploded block, made once (the in-flight
        # and eviction figures read it four times).  Records are deduplicated first; the blocks of
        # one record differ in idx, so only requests left with several records can repeat a block
        # and need the DISTINCT over their blocks.
        return ("CREATE OR REPLACE TABLE pblock AS "
                "WITH r AS (SELECT DISTINCT run, pid, request, block_size, first_block, hashes FROM prompt_blocks), "
                "c AS (SELECT *, COUNT(*) OVER (PARTITION BY run, pid, request, block_size) AS n FROM r), "
                "e AS (SELECT run, pid, request, block_size, n, first_block + generate_subscripts(hashes, 1) - 1 AS idx, "
                "unnest(hashes) AS hash FROM c) "
                "SELECT run, pid, request, block_size, idx, hash FROM e WHERE n = 1 "
                "UNION ALL SELECT DISTINCT run, pid, request, block_size, idx, hash FROM e WHERE n > 1")

    def close(self) -> None:
        for c in self._cursors:
            c.close()
        self.con.close()


def _kind(t: pa.DataType) -> str:
    """An Arrow column type as one of the analysis' column kinds: I, F or S."""
    return "I" if pa.types.is_integer(t) else "F" if pa.types.is_floating(t) else "S"


class SparkEngine(Engine):
    name = "spark"
    types = {"I": "BIGINT", "F": "DOUBLE", "S": "STRING", "H": "DECIMAL(20,0)", "HL": "ARRAY<DECIMAL(20,0)>"}
    _session = None

    def __init__(self, master: str | None = None):
        try:
            from pyspark.sql import SparkSession
        except ImportError:
            raise UsageError("--engine spark needs pyspark: pip install 'kvtrace[spark]' (and Java 17+)") from None
        master = master or os.environ.get("KVTRACE_SPARK_MASTER") or "local[*]"
        if SparkEngine._session is None:
            os.environ.setdefault("PYSPARK_PYTHON", __import__("sys").executable)
            b = (SparkSession.builder.master(master).appName("kvtrace-analyze")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", os.environ.get("KVTRACE_SPARK_PARTITIONS", "2"))
                 .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "2g")
                 .config("spark.sql.ansi.enabled", "false"))
            try:
                SparkEngine._session = b.getOrCreate()
            except Exception as e:
                raise UsageError(f"--engine spark could not start Spark ({master}): {str(e).splitlines()[0][:200]}") from None
            SparkEngine._session.sparkContext.setLogLevel("ERROR")
        self.spark = SparkEngine._session

    def q(self, col: str) -> str:
        return "`" + col.replace("`", "``") + "`"

    def read(self, view: str, files: list[Path]) -> None:
        df = self.spark.read.option("mergeSchema", "true").parquet(*[str(p) for p in files])
        df.createOrReplaceTempView(view)

    def load(self, view: str, table: pa.Table) -> None:
        ddl = ", ".join(f"{self.q(f.name)} {self.types[_kind(f.type)]}" for f in table.schema)
        rows = [tuple(r.values()) for r in table.to_pylist()]
        self.spark.createDataFrame(rows, schema=ddl).createOrReplaceTempView(view)

    def execute(self, sql: str) -> None:
        self.spark.sql(sql)

    def create(self, name: str, sql: str) -> None:
        self.spark.sql(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")
        self.spark.sql(f"CACHE TABLE {name}")

    def rows(self, sql: str) -> list[dict]:
        return [{k: _py(v) for k, v in r.asDict().items()} for r in self.spark.sql(sql).collect()]

    def explode_sql(self) -> str:
        return ("CREATE OR REPLACE TEMP VIEW pblock AS SELECT DISTINCT run, pid, request, block_size, "
                "first_block + pos AS idx, h AS hash FROM prompt_blocks LATERAL VIEW posexplode(hashes) t AS pos, h")

    def close(self) -> None:
        self.spark.catalog.clearCache()
        for v in self.spark.catalog.listTables():
            if v.isTemporary:
                self.spark.catalog.dropTempView(v.name)


def make(name: str, master: str | None = None) -> Engine:
    if name == "duckdb":
        return DuckDBEngine()
    if name == "spark":
        return SparkEngine(master)
    raise UsageError(f"unknown engine {name!r}: duckdb or spark")
