"""`kvtrace correlate DIR`: add the derived tables (requests, chunks, steps, attributions) to a
recorded dataset (a clean stop of `kvtrace attach` does this itself)."""
from __future__ import annotations

import json

import click


@click.command("correlate")
@click.argument("directory", type=click.Path())
@click.option("--run", default=None, help="Only this run id.")
@click.option("--json", "as_json", is_flag=True, help="Print rows written per run and table as JSON.")
@click.option("--force", is_flag=True,
              help="Replace derived tables even by fewer rows (refused otherwise, exit 2: e.g. the hook tables are gone).")
def command(directory, run, as_json, force) -> int:
    """Join kernel I/O and vLLM records into requests, chunks and steps (no root needed)."""
    from kvtrace.correlate.derive import correlate_dataset  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    out = []
    for rc, written in correlate_dataset(directory, run=run, force=force):
        out.append({"run": rc.info.run, "host": rc.info.host, **written})
        if not as_json:
            click.echo(f"kvtrace: run {rc.info.run} ({rc.info.host}): " +
                       ", ".join(f"{n} {k}" for k, n in written.items()), err=True)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    return 0
