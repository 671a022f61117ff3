"""Offline analysis of a recorded dataset (no root, no bcc): `kvtrace analyze` and `kvtrace whatif`.

load.py     which Parquet files make up each table, checked one by one (footer, schema version)
engine.py   the same SQL on DuckDB (default) or Apache Spark (pyspark)
queries.py  the SQL: views over the raw hook and kernel tables, then one query per figure
report.py   runs the queries and assembles the report (dict), with verdicts and stated gaps
render.py   the report as rich tables, JSON or a self-contained HTML page with inline SVG plots
whatif/     replay of the recorded request stream: one driver, and a cache model per server kind
            (vLLM's block pool, SGLang's radix tree) with its scheduler's rules
"""
