"""Which vLLM server a capture traces: the one on --port, the only one (--yes), or the one a
traced pid belongs to."""
from __future__ import annotations

import click

from kvtrace.errors import TargetError, UsageError
from kvtrace.attach.listing import render
from kvtrace.servers import discover as found
from kvtrace.servers import hooksupport


def choose_server(port: int | None, yes: bool):
    """The one vLLM server to trace when neither --pid nor a command is given."""

    servers = found.discover()
    _warn_unreadable(servers)
    if port is not None:
        match = [s for s in servers if s.port == port]
        if len(match) == 1:
            return match[0]
        if not match:
            ports = ", ".join(str(s.port) for s in servers) or "none"
            raise TargetError(f"no vLLM or SGLang server listens on port {port} (servers found on ports: {ports})")
        servers = match
    if not servers:
        raise UsageError("nothing to trace: no vLLM or SGLang server found; give --pid PID, or a command after -- (kvtrace attach --out DIR -- CMD)")
    if len(servers) == 1 and (yes or port is not None):
        return servers[0]
    render(servers, hooks=[hooksupport.label(hooksupport.verdict(s)) for s in servers])
    if len(servers) == 1:
        raise UsageError("found 1 server: pass --yes to attach to it, or pick it with --port PORT / --pid PID")
    raise UsageError(f"found {len(servers)} servers: pick one with --port PORT or --pid PID")


def _warn_unreadable(servers) -> None:
    """One line on stderr per process discovery could not inspect (it may be a server)."""
    for u in getattr(servers, "unreadable", []):
        click.echo(f"kvtrace: warning: {u.line()}", err=True)


def server_of(pids) -> object | None:
    """The discovered vLLM server one of these pids belongs to, if any."""

    for server in found.discover():
        if set(pids) & set(server.pids):
            return server
    return None
