"""`kvtrace export DIR --otlp URL`: send a recorded dataset as OTLP traces and metrics."""
from __future__ import annotations

import json

import click

from kvtrace.commands.params import Seconds
from kvtrace.errors import ExportError


@click.command("export")
@click.argument("directory", type=click.Path())
@click.option("--otlp", "url", required=True, metavar="URL",
              help="OTLP endpoint: http://host:4317 (gRPC) or http://host:4318 (HTTP/protobuf).")
@click.option("--otlp-protocol", "protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--run", default=None, help="Only this run id.")
@click.option("--timeout", type=Seconds(), default=10.0, show_default=True, help="Seconds per OTLP request (more than 0).")
@click.option("--json", "as_json", is_flag=True, help="Print what was sent as JSON.")
def command(directory, url, protocol, run, timeout, as_json) -> int:
    """Replay a recorded dataset as the same spans `kvtrace attach --otlp` streams live.

    One trace per request (joining the request's W3C trace when it carried one), a span per
    prefill chunk, and the KV transfers and storage I/O under it; OTLP metrics at the end.
    """
    from kvtrace.otlp.exporter import parse_endpoint  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.otlp.sink import replay  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    parse_endpoint(url, protocol)  # bad URL: one line, exit 2, before reading anything

    def progress(row, exp):
        if not as_json:
            click.echo(f"kvtrace: run {row['run']} ({row['host']}): {row['requests']} requests, {row['chunks']} chunks; "
                       + exp.describe(), err=True)

    _, rows = replay(directory, url, protocol, run=run,
                     exporter_kw={"max_queue": 1 << 30, "max_queue_bytes": 1 << 40, "timeout": timeout},
                     progress=progress)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    spans = sum(r["spans"] for r in rows)
    if spans and not sum(r["sent"] for r in rows):
        last = next((r["last_error"] for r in rows if r["last_error"]), "no answer")
        raise ExportError(f"no span reached {url} ({protocol}): {last}")
    if any(r["dropped"] for r in rows):
        click.echo(f"kvtrace: warning: {sum(r['dropped'] for r in rows)} of {spans} spans were not delivered", err=True)
    return 0
