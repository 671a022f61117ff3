"""`kvtrace servers`: list the vLLM servers running on this host."""
from __future__ import annotations

import json
import os

import click


def kv_label(info) -> str:
    kv = info.kv_events
    if kv is None or not kv.enabled:
        return "off"
    out = kv.endpoint or "?"
    if kv.replay_endpoint:
        out += f" replay {kv.replay_endpoint}"
    if kv.dp_size > 1:
        out += f" ({kv.dp_size} DP ranks: port + rank)"
    return out


def where(info) -> str:
    """' [container]' / ' [netns net:[…]]' when the server lives apart from kvtrace."""
    tags = ["container"] if info.in_container else []
    if info.netns:
        tags.append(f"own network {info.netns_id}")
    return f" [{', '.join(tags)}]" if tags else ""


def _console(stderr: bool):
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=200)


def render(servers, console=None) -> None:
    """The servers as a rich table (to stderr by default, so stdout stays clean for pipes)."""
    from rich.table import Table

    console = console or _console(stderr=True)
    t = Table(title=f"vLLM servers ({len(servers)})", title_justify="left")
    for col in ("API pid", "port", "EngineCore", "Workers", "Python", "vLLM", "plugin"):
        t.add_column(col, no_wrap=True)
    t.add_column("KV events", overflow="fold", min_width=12)
    t.add_column("model", overflow="fold", min_width=10)
    for s in servers:
        t.add_row(
            " ".join(map(str, s.api_pids)), str(s.port) if s.port is not None else "-",
            " ".join(map(str, s.engine_pids)) or "-", " ".join(map(str, s.worker_pids)) or "-",
            s.python_version or "?", s.vllm_version or "?",
            {"installed": "yes", "absent": "no"}.get(s.plugin, s.plugin), kv_label(s),
            (os.path.basename((s.model or "?").rstrip("/")) or s.model) + where(s),
        )
    console.print(t)


@click.command("servers")
@click.option("--json", "as_json", is_flag=True, help="Print the servers as JSON (one array) on stdout.")
def command(as_json: bool) -> int:
    """List running vLLM servers: pids, port, versions, KV-event endpoint, kvtrace plugin."""
    from kvtrace.vllm.discover import discover

    servers = discover()
    if as_json:
        click.echo(json.dumps([s.to_json() for s in servers], indent=2))
        return 0
    if not servers:
        click.echo("kvtrace: no vLLM server found (looked for `vllm serve` / `python -m vllm.entrypoints...`)", err=True)
        return 0
    render(servers, _console(stderr=False))
    return 0
