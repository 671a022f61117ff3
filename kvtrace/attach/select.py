"""Which servers a capture traces: those on --port (repeatable), every one (--all), the only one
(--yes), or the one a traced pid belongs to."""
from __future__ import annotations

import click

from kvtrace.errors import TargetError, UsageError
from kvtrace.attach.listing import render
from kvtrace.servers import discover as found
from kvtrace.servers import hooksupport


def choose_servers(ports: list[int], every: bool, yes: bool) -> list:
    """The servers to trace when neither --pid nor a command is given: those on ``ports``, every
    one found (--all), or the only one (--yes)."""
    servers = found.discover()
    _warn_unreadable(servers)
    if every:
        if not servers:
            raise UsageError("nothing to trace: no vLLM or SGLang server found (--all); start one, or give --pid PID")
        return list(servers)
    if ports:
        return [_on_port(servers, port) for port in dict.fromkeys(ports)]
    if not servers:
        raise UsageError("nothing to trace: no vLLM or SGLang server found; give --pid PID, or a command after -- (kvtrace attach --out DIR -- CMD)")
    if len(servers) == 1 and yes:
        return [servers[0]]
    render(servers, hooks=[hooksupport.label(hooksupport.verdict(s)) for s in servers])
    if len(servers) == 1:
        raise UsageError("found 1 server: pass --yes to attach to it, or pick it with --port PORT / --pid PID")
    raise UsageError(f"found {len(servers)} servers: pick them with --port PORT (repeatable), --all, or --pid PID")


def _on_port(servers, port: int):
    match = [s for s in servers if s.port == port]
    if len(match) == 1:
        return match[0]
    if not match:
        ports = ", ".join(str(s.port) for s in servers) or "none"
        raise TargetError(f"no vLLM or SGLang server listens on port {port} (servers found on ports: {ports})")
    render(match, hooks=[hooksupport.label(hooksupport.verdict(s)) for s in match])
    raise UsageError(f"found {len(match)} servers on port {port} (in different network namespaces): pick one with --pid PID")


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
