"""`kvtrace servers`: list the vLLM servers running on this host."""
from __future__ import annotations

import json

import click

from kvtrace.attach.listing import _console, render

@click.command("servers")
@click.option("--json", "as_json", is_flag=True, help="Print the servers as JSON (one array) on stdout.")
def command(as_json: bool) -> int:
    """List running vLLM servers: pids, port, versions, KV-event endpoint, kvtrace plugin."""
    from kvtrace.vllm.discover import discover  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    servers = discover()
    if as_json:
        click.echo(json.dumps([s.to_json() for s in servers], indent=2))
        return 0
    if not servers:
        click.echo("kvtrace: no vLLM server found (looked for `vllm serve` / `python -m vllm.entrypoints...`)", err=True)
        return 0
    render(servers, _console(stderr=False))
    return 0
