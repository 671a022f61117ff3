"""`kvtrace analyze DIR`: the bottleneck report of a recorded dataset (no root, no bcc)."""
from __future__ import annotations

import click

from kvtrace.dataset.writer import write_text


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
@click.option("--wide", is_flag=True,
              help="Show every column and full request ids, however wide the lines get (for `less -S` or a file).")
def command(directory, as_json, html_path, engine, spark_master, block_size, wide) -> int:
    """How chunked prefill affects KV reuse, and whether compute, storage or queueing bounds each chunk.

    The report fits the width of the terminal: $COLUMNS when set, else the terminal's size (that
    of stdin or stderr when stdout is a pipe or a file), else 80 columns.  Where a table does not
    fit, text wraps first, then request ids shrink to their last characters (at least 8, as many
    as make them unique: vLLM's random suffix), listed with their full ids at the end, then the
    least important columns are left out and named under the table.  --wide shows everything;
    --json has every full id.
    """
    from kvtrace.analysis import render  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.analysis.report import analyze  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    rep = analyze(directory, engine=engine, master=spark_master, block_size=block_size)
    if html_path:
        write_text(html_path, render.to_html(rep))   # 0600, like the dataset it describes
    if as_json:
        click.echo(render.to_json(rep))
    else:
        render.terminal(rep, wide=wide)
    for g in rep["gaps"] if as_json else []:
        click.echo(f"kvtrace: gap: {g}", err=True)
    return 0
