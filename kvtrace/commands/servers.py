"""`kvtrace servers`: list the vLLM and SGLang servers running on this host."""
from __future__ import annotations

import json

import click

from kvtrace.attach.listing import _console, render

@click.command("servers")
@click.option("--json", "as_json", is_flag=True, help="Print the servers as JSON (one array) on stdout.")
def command(as_json: bool) -> int:
    """List running vLLM and SGLang servers: pids, port, versions, whether the hook supports their vLLM
    (and the first thing that differs where it does not), KV-event endpoint, kvtrace plugin.  A
    process that could not be inspected (its reads did not return in time, or a file of its
    environment is not safe to read) is listed as `pid N: unreadable (reason)`."""
    from kvtrace.servers.discover import discover  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.servers import hooksupport  # lazy: start-up cost, as above

    servers = discover()
    unreadable = getattr(servers, "unreadable", [])
    verdicts = [hooksupport.verdict(s) for s in servers]
    if as_json:
        rows = [{**s.to_json(), "hook": hooksupport.to_json(v), "unreadable": None} for s, v in zip(servers, verdicts)]
        click.echo(json.dumps(rows + [u.to_json() for u in unreadable], indent=2))
        return 0
    if not servers:
        click.echo("kvtrace: no vLLM or SGLang server found (looked for `vllm serve` / `python -m vllm.entrypoints...`"
                   " / `python -m sglang.launch_server` / `sglang serve`)", err=True)
    else:
        console = _console(stderr=False)
        render(servers, console, hooks=[hooksupport.label(v) for v in verdicts])
        for s, v in zip(servers, verdicts):
            if v is None or not v["supported"]:
                console.print(f"server {s.pid}: {hooksupport.describe(s, v)}", highlight=False, soft_wrap=True)
    for u in unreadable:
        click.echo(u.line())
    return 0
