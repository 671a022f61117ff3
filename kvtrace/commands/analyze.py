"""`kvtrace analyze DIR`: the bottleneck report of a recorded dataset (no root, no bcc)."""
from __future__ import annotations

import click

from kvtrace.errors import OutputError


@click.command("analyze")
@click.argument("directory", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Also write a self-contained HTML page with plots to this file.")
@click.option("--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True,
              help="Run the SQL on DuckDB (one machine) or Apache Spark (pyspark).")
@click.option("--spark-master", default=None, help="Spark master URL (default local[*], or $KVTRACE_SPARK_MASTER).")
@click.option("--block-size", type=click.IntRange(0), default=0,
              help="Tokens per KV block, when the dataset cannot tell (no prompt_blocks records and no hit).")
def command(directory, as_json, html_path, engine, spark_master, block_size) -> int:
    """How chunked prefill affects KV reuse, and whether compute, storage or queueing bounds each chunk."""
    from kvtrace.analysis import render
    from kvtrace.analysis.report import analyze

    rep = analyze(directory, engine=engine, master=spark_master, block_size=block_size)
    if html_path:
        try:
            with open(html_path, "w") as f:
                f.write(render.to_html(rep))
        except OSError as e:
            raise OutputError(f"cannot write {html_path}: {e.strerror}") from None
    if as_json:
        click.echo(render.to_json(rep))
    else:
        render.terminal(rep)
    for g in rep["gaps"] if as_json else []:
        click.echo(f"kvtrace: gap: {g}", err=True)
    return 0
