"""The KV tier servers a traced engine's connectors reach (kvtrace.servers.tiers): found when
attach finds the engine, traced with it (their processes' kernel I/O: an `fs` L2's reads and
writes), named in the dataset's `tiers` table and on stderr, their own metrics scraped into
`tier_metrics` (inside their network namespace), and their kind's hook injected for the capture
(tier_lookup, tier_op records; taken out at the end)."""
from __future__ import annotations

import os
import time


def follow(server, echo) -> list:
    """The tier servers of ``server`` (none without a server or a tier connector)."""
    if server is None:
        return []
    from kvtrace.servers import tiers  # lazy: start-up cost: the CLI imports attach's options for every command

    found = tiers.find(server)
    for t in found:
        where = "" if t.same_netns else ", in another network namespace"
        lower = f", L2 {', '.join(t.storage)}" if t.storage else ""
        echo(f"kvtrace: tracing {tiers.TIERS[t.kind].title}'s server (pid {', '.join(map(str, t.pids))}, "
             f"port {t.port}{where}{lower}) that {t.connector} reaches")
    return found


def table(found: list):
    """The `tiers` table's rows (a pyarrow Table)."""
    import pyarrow as pa  # lazy: start-up cost: the CLI imports attach's options for every command

    from kvtrace.dataset import schema  # lazy: as pyarrow

    now = time.monotonic_ns()
    rows = [{"ts_ns": now, "kind": t.kind, "pid": t.pid, "address": t.host, "port": t.port, "connector": t.connector,
             "version": t.version, "storage": ",".join(t.storage), "chunk_tokens": t.chunk_tokens,
             "same_netns": t.same_netns, "memory_bytes": t.memory_bytes} for t in found]
    return pa.Table.from_pylist(rows, schema=schema.TABLES["tiers"])


def scrapers(found: list, interval: float, echo) -> list:
    """A started metrics scraper per tier server that serves its metrics (a sidecar each)."""
    from kvtrace.servers import tiers  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.servers.metrics import MetricsScraper  # lazy: as above

    out = []
    for t in found:
        if not t.metrics_url:
            continue
        kind = tiers.TIERS[t.kind]
        ns = f"/proc/{t.pid}/ns/net" if _netns(t.pid) != _netns("self") else None
        scraper = MetricsScraper(t.metrics_url, interval=interval, kind=t.kind, prefixes=(kind.metrics_prefix,),
                                 netns=ns, table="tier_metrics")
        for w in scraper.start():
            echo(f"kvtrace: warning: {kind.title} {w}")
        out.append(scraper)
        echo(f"kvtrace: {kind.title} metrics from {t.metrics_url} every {interval:g}s"
             + (" inside its network namespace" if ns else ""))
    return out


def _netns(pid) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


class TierHooks:
    """The tier servers this capture injected a hook into; ``uninstall()`` takes it out."""

    def __init__(self):
        self.installed: list[tuple[int, str]] = []   # (pid, hook module)

    def uninstall(self) -> None:
        from kvtrace.errors import KvtraceError  # lazy: as above
        from kvtrace.inject import injector  # lazy: as above

        for pid, module in self.installed:
            if os.path.exists(f"/proc/{pid}"):
                try:
                    injector.hook(pid, "uninstall", module=module)
                except KvtraceError:
                    pass   # it leaves by itself once this agent is gone


def inject(found: list, enabled: bool, usermark: bool, echo, flag=None) -> TierHooks | None:
    """Inject each tier server's hook (not with --no-inject or without the usermark probe)."""
    if not found or not enabled or not usermark:
        return None
    from kvtrace.errors import KvtraceError  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.host.confined import UnsafePath  # lazy: as above
    from kvtrace.inject import injector  # lazy: as above
    from kvtrace.servers import tiers  # lazy: as above

    hooks = TierHooks()
    for t in found:
        kind = tiers.TIERS[t.kind]
        if not kind.hook_module:
            continue
        try:
            if flag is not None:
                flag.add_root(f"/proc/{t.pid}/root")
            rep = injector.hook(t.pid, "install", module=kind.hook_module)
        except (KvtraceError, UnsafePath) as e:
            echo(f"kvtrace: {kind.title} signals missing in its server {t.pid}: {e}")
            continue
        status = rep.get("status") or {}
        if rep.get("installed"):
            if not rep.get("reused"):
                hooks.installed.append((t.pid, kind.hook_module))
            echo(f"kvtrace: {kind.title} hook {'already active' if rep.get('reused') else 'injected'} in its server {t.pid}")
        else:
            why = f"the hook failed to load: {rep['error']}" if rep.get("error") else status.get("reason", "?")
            echo(f"kvtrace: {kind.title} signals missing in its server {t.pid}: {why}")
    return hooks
