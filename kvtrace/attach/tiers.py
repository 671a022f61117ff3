"""The KV tier servers a traced engine's connectors reach (kvtrace.servers.tiers): found when
attach finds the engine, traced with it (their processes' kernel I/O: an `fs` L2's reads and
writes), named in the dataset's `tiers` table and on stderr, their own metrics scraped into
`tier_metrics` (inside their network namespace)."""
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
             "version": t.version, "storage": ",".join(t.storage), "same_netns": t.same_netns} for t in found]
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
