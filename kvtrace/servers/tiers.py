"""From a traced engine to the KV tier servers its connectors reach: the kv-transfer config on
the engine's command line names each connector (a MultiConnector's too) and, for a tier kind of
TIERS, where its server listens; the server is the process recognised as that kind (by its
command line) that holds a socket listening on that port, in the engine's network namespace first (the same host or container), else the one
such process on the host (another container).  Read-only /proc reads; a process that cannot be
read is passed over."""
from __future__ import annotations

import json
import os

import psutil

from kvtrace.host.confined import UnsafePath
from kvtrace.servers import lmcache
from kvtrace.servers.procfs import _arg, _dotted, _environ, environment, listening
from kvtrace.servers.tier import TierInfo, TierKind

TIERS: dict[str, TierKind] = {t.name: t for t in (lmcache.TIER,)}
_BY_CONNECTOR = {c: t for t in TIERS.values() for c in t.connectors}


def transfer_config(cmdline: list[str]) -> dict:
    """vLLM's ``--kv-transfer-config`` (JSON, then dotted keys over it); {} when absent or unreadable."""
    cfg: dict = {}
    raw = _arg(cmdline, "--kv-transfer-config")
    if raw:
        try:
            parsed = json.loads(raw)
            cfg = parsed if isinstance(parsed, dict) else {}
        except ValueError:
            cfg = {}
    cfg.update(_dotted(cmdline, "--kv-transfer-config"))
    return cfg


def connectors(cfg: dict) -> list[tuple[str, dict]]:
    """(connector class name, its extra config) of each connector, a MultiConnector's in order."""
    name = str(cfg.get("kv_connector") or "")
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        extra = {}
    if name == "MultiConnector":
        return [c for sub in extra.get("connectors") or () if isinstance(sub, dict) for c in connectors(sub)]
    return [(name, extra)] if name else []


def find(server) -> list[TierInfo]:
    """The tier servers the engine's connectors reach (those found; one per connector)."""
    out = []
    for name, extra in connectors(transfer_config(server.cmdline)):
        tier = _BY_CONNECTOR.get(name)
        if tier is None:
            continue
        try:
            host, port = tier.endpoint(extra)
        except (TypeError, ValueError):
            continue
        proc, same = _server_process(tier, port, server.pid)
        if proc is not None:
            out.append(_describe(tier, proc, host, port, name, same))
    return out


def _netns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _server_process(tier: TierKind, port: int, engine_pid: int) -> tuple[psutil.Process | None, bool]:
    """(the process of ``tier`` serving ``port``, whether it is in the engine's network namespace)."""
    mine, elsewhere = [], []
    ns = _netns(engine_pid)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            argv = proc.info["cmdline"] or []
        except (psutil.Error, OSError):
            continue
        if argv and tier.recognise(argv) == port and not _is_child_of_same(proc, tier) and _listens(proc.pid, port):
            (mine if ns is not None and _netns(proc.pid) == ns else elsewhere).append(proc)
    if len(mine) == 1:
        return mine[0], True
    if not mine and len(elsewhere) == 1:
        return elsewhere[0], False
    return None, False


def _listens(pid: int, port: int) -> bool:
    """The process holds a TCP socket listening on ``port``: a command line alone (which any user
    writes) does not make a process the tier server kvtrace traces and injects into."""
    return any(p == port for _host, p in listening(pid))


def _is_child_of_same(proc: psutil.Process, tier: TierKind) -> bool:
    """A worker the server forked with its own command line (traced as the server's child)."""
    try:
        parent = proc.parent()
        return parent is not None and tier.recognise(parent.cmdline()) is not None
    except (psutil.Error, OSError):
        return False


def _describe(tier: TierKind, proc: psutil.Process, host: str, port: int, connector: str, same: bool) -> TierInfo:
    try:
        children = [c.pid for c in proc.children(recursive=True)]
        argv = proc.cmdline()
    except (psutil.Error, OSError):
        children, argv = [], []
    try:
        version = environment(proc, argv, _environ(proc), tier.package, "")["version"] if argv else None
    except (UnsafePath, OSError, psutil.Error, KeyError):
        version = None
    return TierInfo(kind=tier.name, pid=proc.pid, pids=[proc.pid, *children], host=host, port=port,
                    connector=connector, version=version, storage=tier.storage(argv), chunk_tokens=tier.chunk_size(argv),
                    same_netns=same, metrics_url=tier.metrics(argv) if argv else None,
                    memory_bytes=tier.memory(argv) if argv else 0)
