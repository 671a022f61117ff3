"""The server-side streams of a capture: the KV-event subscriber(s) and the /metrics scraper."""
from __future__ import annotations

import sys
from kvtrace.servers import kvevents, kvpeer, registry
from kvtrace.servers.metrics import MetricsScraper


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _server_procs(server, pids) -> kvpeer.ServerProcs | None:
    """The processes whose KV events are taken: the server (its pid, or the server on its port
    after a restart, and their children), else the traced ``pids``; None when neither is known."""
    if server is not None:
        return kvpeer.ServerProcs(kvpeer.server_roots(server))
    return kvpeer.ServerProcs(list(pids)) if pids else None


def _scraper(server, url: str, interval: float, ns: str | None) -> MetricsScraper:
    """The /metrics scraper: the server's kind and its series; without a discovered server (a
    --metrics-url of its own) no kind, and the series of every kind kvtrace knows."""
    if server is not None:
        kind = registry.kind(server.kind)
        return MetricsScraper(url, interval=interval, netns=ns, kind=kind.name, prefixes=(kind.metrics_prefix,))
    prefixes = tuple(registry.kind(n).metrics_prefix for n in registry.names())
    return MetricsScraper(url, interval=interval, netns=ns, kind=None, prefixes=prefixes)


def start_vllm_streams(server, kv_events: str | None, kv_replay: str | None, metrics_url: str | None,
                       metrics_interval: float, echo=_stderr, pids=None) -> list:
    """Start the KV-event subscriber(s) and the /metrics scraper for this capture.

    Explicit --kv-events / --metrics-url win over what discovery found.  An endpoint that
    cannot be reached gives one warning line; capture goes on (the threads keep retrying).
    KV events are taken only from the server's processes (or, without a discovered server,
    from ``pids``, the traced processes); with neither, kvtrace does not listen for them.
    """

    sidecars, notes = [], []
    root = f"/proc/{server.pid}/root" if server is not None and server.in_container else None
    ns = getattr(server, "netns", None)  # the server's own network namespace, when not kvtrace's
    endpoints: list[tuple[str, str | None, str]] = []  # (vLLM-side endpoint, replay, topic)
    binds = None  # SGLang's explicit bind setting
    peers = _server_procs(server, pids)
    if kv_events:
        endpoints.append((kv_events, kv_replay, ""))
    elif server is not None and server.kv_events is not None and server.kv_events.enabled:
        kv = server.kv_events
        binds = kv.bind
        for rank in range(kv.dp_size):
            endpoints.append((kvevents.rank_endpoint(kv.endpoint, rank),
                              kvevents.rank_endpoint(kv.replay_endpoint, rank), kv.topic))
    for endpoint, replay, topic in endpoints:
        try:
            address, bind = kvevents.subscriber_endpoint(endpoint, root=root, publisher_binds=binds)
        except ValueError as e:
            echo(f"kvtrace: warning: {e}; capture continues without kv_events")
            continue
        if bind and peers is None:
            echo(f"kvtrace: warning: the server connects out to the KV events endpoint {endpoint}, but kvtrace knows "
                 "no server process to take events from (attach with --port or --pid of the server); "
                 "capture continues without kv_events")
            continue
        sub = kvevents.KvEventSubscriber(address, kvevents.replay_address(replay, root=root) if replay else None,
                                         topic=topic, bind=bind, netns=ns, peers=peers,
                                         echo=lambda w: echo(f"kvtrace: warning: {w}"))
        for w in sub.start():
            echo(f"kvtrace: warning: {w}")
        sidecars.append(sub)
        notes.append(f"kv_events from {sub.endpoint}" + (" (bound: vLLM connects to it)" if sub.bind else ""))
    if server is not None and server.kv_events is not None and not server.kv_events.enabled and not kv_events:
        notes.append("no kv_events (the server was started without KV events)")
    elif server is not None and server.kv_events is None and not kv_events:
        notes.append("no kv_events (the server was started without --kv-events-config)")
    url = metrics_url or (server.metrics_url if server is not None else None)
    if url:
        scraper = _scraper(server, url, metrics_interval, ns)
        for w in scraper.start():
            echo(f"kvtrace: warning: {w}")
        sidecars.append(scraper)
        notes.append(f"{scraper.name} from {url} every {metrics_interval:g}s")
    if notes and ns:
        notes.append(f"inside the server's network namespace {server.netns_id}")
    if notes:
        name = f"{registry.kind(server.kind).title} " if server is not None else ""
        echo(f"kvtrace: {name}streams: " + "; ".join(notes))
    return sidecars
