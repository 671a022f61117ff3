"""One SQL text, two engines: DuckDB (default, in process) and Apache Spark (pyspark).

Each table becomes a view with the analysis' column names and types (BIGINT integers, DOUBLE,
text; 64-bit hashes stay unsigned: UBIGINT in DuckDB, DECIMAL(20,0) in Spark).  A table the
dataset lacks becomes an empty view with the same columns, so every query runs.  Results come
back as plain Python values (Decimal -> int), so the two engines' reports compare equal.
"""
from __future__ import annotations

import decimal
import os

import pyarrow as pa
from pathlib import Path

from kvtrace.analysis.load import COLUMNS, Inputs
from kvtrace.errors import UsageError


def _py(v):
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    return v


class Engine:
    name = "?"
    types = {"I": "BIGINT", "F": "DOUBLE", "S": "VARCHAR"}

    def q(self, col: str) -> str:
        raise NotImplementedError

    def read(self, view: str, files: list[Path]) -> None:
        raise NotImplementedError

    def execute(self, sql: str) -> None:
        raise NotImplementedError

    def rows(self, sql: str) -> list[dict]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def create(self, name: str, sql: str) -> None:
        """A derived table the figures read (materialized once: several figures share it)."""
        self.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")

    def null(self, kind: str) -> str:
        return f"CAST(NULL AS {self.types[kind]})"

    def register(self, inp: Inputs) -> None:
        for table, cols in COLUMNS.items():
            files = inp.files.get(table, [])
            have = inp.present.get(table, set()) if files else set()
            exprs = [f"COALESCE(CAST({self.q('run')} AS {self.types['S']}), '') AS run" if "run" in have else "'' AS run"]
            for src, alias, kind in cols:
                if src not in have:
                    exprs.append(f"{self.null(kind)} AS {alias}")
                elif kind in ("H", "HL"):
                    exprs.append(f"{self.q(src)} AS {alias}")
                else:
                    exprs.append(f"CAST({self.q(src)} AS {self.types[kind]}) AS {alias}")
            if files:
                self.read(f"raw_{table}", files)
                self.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT {', '.join(exprs)} FROM raw_{table}")
            else:
                self.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT {', '.join(exprs)} FROM {self.one_row()} WHERE 1 = 0")
        self.execute(self.explode_sql())

    def one_row(self) -> str:
        return "(SELECT 1 AS x) t0"

    def explode_sql(self) -> str:
        raise NotImplementedError


class DuckDBEngine(Engine):
    name = "duckdb"
    types = {"I": "BIGINT", "F": "DOUBLE", "S": "VARCHAR", "H": "UBIGINT", "HL": "UBIGINT[]"}

    def __init__(self, threads: int | None = None):
        import duckdb

        self.con = duckdb.connect(":memory:")
        self.con.execute("SET enable_progress_bar = false")
        if threads:
            self.con.execute(f"SET threads = {int(threads)}")

    def q(self, col: str) -> str:
        return '"' + col.replace('"', '""') + '"'

    def read(self, view: str, files: list[Path]) -> None:
        lst = ", ".join("'" + str(p).replace("'", "''") + "'" for p in files)
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW {view} AS SELECT * FROM read_parquet([{lst}], union_by_name = true)")

    def execute(self, sql: str) -> None:
        self.con.execute(sql)

    def create(self, name: str, sql: str) -> None:
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS {sql}")

    def rows(self, sql: str) -> list[dict]:
        t = self.con.sql(sql).to_arrow_table()
        if any(pa.types.is_decimal(f.type) for f in t.schema):  # SUM of BIGINT is HUGEINT: back to int64
            t = t.cast(pa.schema([pa.field(f.name, (pa.int64() if f.type.scale == 0 else pa.float64())
                                           if pa.types.is_decimal(f.type) else f.type) for f in t.schema]))
        return t.to_pylist()

    def explode_sql(self) -> str:
        return ("CREATE OR REPLACE TEMP VIEW pblock AS SELECT DISTINCT run, pid, request, block_size, idx, hash FROM ("
                "SELECT run, pid, request, block_size, first_block + generate_subscripts(hashes, 1) - 1 AS idx, "
                "unnest(hashes) AS hash FROM prompt_blocks) t")

    def close(self) -> None:
        self.con.close()


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
