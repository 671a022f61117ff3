"""`kvtrace attach`: capture the storage I/O of chosen processes into a Parquet dataset."""
from __future__ import annotations

import signal
import time

import click

from kvtrace.agentflag import AgentFlag
from kvtrace.capture import BY_NAME, program
from kvtrace.dataset.writer import DatasetWriter
from kvtrace.errors import OutputError, PrivilegeError, TargetError, UsageError
from kvtrace.fabric import session as fabric
from kvtrace.host import privileges, tracefs
from kvtrace.status import StatusLine


class Stop:
    """Why capture ends: a signal, --duration, or every traced process gone."""

    def __init__(self, duration: float | None):
        self.reason = None
        self.deadline = time.monotonic() + duration if duration else None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.reason = signal.Signals(signum).name

    def check(self, source, watch=None) -> str | None:
        """``watch``: the vLLM server's watch (kvtrace.vllm.restart), which decides what its
        processes exiting means; without one, every traced process gone ends the capture."""
        if self.reason:
            return self.reason
        if self.deadline and time.monotonic() >= self.deadline:
            self.reason = "duration"
        elif watch is not None:
            self.reason = watch.poll()
        elif not source.targets():
            self.reason = "all traced processes exited"
        return self.reason


def choose_server(port: int | None, yes: bool):
    """The one vLLM server to trace when neither --pid nor a command is given."""
    from kvtrace.commands.servers import render
    from kvtrace.vllm.discover import discover

    servers = discover()
    if port is not None:
        match = [s for s in servers if s.port == port]
        if len(match) == 1:
            return match[0]
        if not match:
            ports = ", ".join(str(s.port) for s in servers) or "none"
            raise TargetError(f"no vLLM server listens on port {port} (vLLM servers found on ports: {ports})")
        servers = match
    if not servers:
        raise UsageError("nothing to trace: no vLLM server found; give --pid PID, or a command after -- (kvtrace attach --out DIR -- CMD)")
    if len(servers) == 1 and (yes or port is not None):
        return servers[0]
    render(servers)
    if len(servers) == 1:
        raise UsageError("found 1 vLLM server: pass --yes to attach to it, or pick it with --port PORT / --pid PID")
    raise UsageError(f"found {len(servers)} vLLM servers: pick one with --port PORT or --pid PID")


def server_of(pids) -> object | None:
    """The discovered vLLM server one of these pids belongs to, if any."""
    from kvtrace.vllm.discover import discover

    for server in discover():
        if set(pids) & set(server.pids):
            return server
    return None


def inject_hook(server, inject: bool, usermark: bool):
    """Inject the vLLM hook (unless refused or --no-inject); say which signals are missing."""
    from kvtrace.inject.session import InjectionSession

    if server is None:
        return None
    if not inject or not usermark:
        why = "--no-inject" if not inject else "the usermark probe is not attached"
        click.echo(f"kvtrace: vLLM signals missing (steps, chunks, hits, evictions, KV loads): {why}; "
                   "kernel probes, KV events and /metrics still run", err=True)
        return None
    session = InjectionSession(server)
    try:
        results = session.install()
    except TargetError as e:
        click.echo(f"kvtrace: vLLM signals missing: {e}", err=True)
        return None
    for r in results:
        if r.installed:
            click.echo(f"kvtrace: vLLM hook {'already active' if r.reused else 'injected'} in {r.role} {r.pid}", err=True)
    for line in session.missing():
        click.echo(f"kvtrace: vLLM signals missing in {line}", err=True)
    return session


def start_vllm_streams(server, kv_events: str | None, kv_replay: str | None, metrics_url: str | None,
                       metrics_interval: float) -> list:
    """Start the KV-event subscriber(s) and the /metrics scraper for this capture.

    Explicit --kv-events / --metrics-url win over what discovery found.  An endpoint that
    cannot be reached gives one warning line; capture goes on (the threads keep retrying).
    """
    from kvtrace.vllm import kvevents
    from kvtrace.vllm.metrics import MetricsScraper

    sidecars, notes = [], []
    root = f"/proc/{server.pid}/root" if server is not None and server.in_container else None
    endpoints: list[tuple[str, str | None, str]] = []  # (vLLM-side endpoint, replay, topic)
    if kv_events:
        endpoints.append((kv_events, kv_replay, ""))
    elif server is not None and server.kv_events is not None and server.kv_events.enabled:
        kv = server.kv_events
        for rank in range(kv.dp_size):
            endpoints.append((kvevents.rank_endpoint(kv.endpoint, rank),
                              kvevents.rank_endpoint(kv.replay_endpoint, rank), kv.topic))
    for endpoint, replay, topic in endpoints:
        try:
            address, bind = kvevents.subscriber_endpoint(endpoint, root=root)
        except ValueError as e:
            click.echo(f"kvtrace: warning: {e}; capture continues without kv_events", err=True)
            continue
        sub = kvevents.KvEventSubscriber(address, kvevents.replay_address(replay, root=root) if replay else None,
                                         topic=topic, bind=bind)
        for w in sub.start():
            click.echo(f"kvtrace: warning: {w}", err=True)
        sidecars.append(sub)
        notes.append(f"kv_events from {address}" + (" (bound: vLLM connects to it)" if sub.bind else ""))
    if server is not None and server.kv_events is not None and not server.kv_events.enabled and not kv_events:
        notes.append("no kv_events (the server was started without KV events)")
    elif server is not None and server.kv_events is None and not kv_events:
        notes.append("no kv_events (the server was started without --kv-events-config)")
    url = metrics_url or (server.metrics_url if server is not None else None)
    if url:
        scraper = MetricsScraper(url, interval=metrics_interval)
        for w in scraper.start():
            click.echo(f"kvtrace: warning: {w}", err=True)
        sidecars.append(scraper)
        notes.append(f"vllm_metrics from {url} every {metrics_interval:g}s")
    if notes:
        click.echo("kvtrace: vLLM streams: " + "; ".join(notes), err=True)
    return sidecars


@click.command("attach", context_settings={"ignore_unknown_options": False})
@click.option("--pid", "pids", type=int, multiple=True, help="Process to trace (all its threads, and children started later). Repeatable.")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Dataset directory to write (created if missing).")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds.")
@click.option("--probe", "probe_names", multiple=True, type=click.Choice(sorted(BY_NAME)), help="Only these probes (default: all this kernel supports).")
@click.option("--no-writes", is_flag=True, help="Do not trace write system calls.")
@click.option("--ringbuf-pages", type=int, default=4096, show_default=True, help="Ring buffer size in pages (a power of two).")
@click.option("--flush-interval", type=float, default=1.0, show_default=True, help="Seconds between Parquet part files (a crash loses at most this much).")
@click.option("--quiet", is_flag=True, help="No live status line.")
@click.option("--sampling", "sampling", default="auto", show_default=True, metavar="auto|off|N",
              help="Raw block/file/io_uring events: auto samples them (1 in N, each row with its weight) while the ring "
                   "buffer overflows and stops once it keeps up; off never samples (losses are counted); N keeps 1 in N. "
                   "The *_agg tables count every event in the kernel either way.")
@click.option("--raw-out", type=click.Path(dir_okay=False), default=None, help="Also keep the raw ring-buffer records in this file (for bug reports and decoder tests).")
@click.option("--port", type=int, default=None, help="Trace the vLLM server listening on this port (API server, EngineCore, Workers).")
@click.option("--yes", is_flag=True, help="Without --pid or a command: attach to the only vLLM server found.")
@click.option("--kv-events", "kv_events", default=None, metavar="ENDPOINT", help="vLLM KV-event endpoint as given to vLLM's --kv-events-config (default: from the discovered server).")
@click.option("--kv-replay", "kv_replay", default=None, metavar="ENDPOINT", help="vLLM KV-event replay endpoint, with --kv-events.")
@click.option("--metrics-url", default=None, metavar="URL", help="vLLM Prometheus URL to scrape (default: the discovered server's /metrics).")
@click.option("--metrics-interval", type=float, default=1.0, show_default=True, help="Seconds between /metrics scrapes.")
@click.option("--otlp", "otlp", default=None, metavar="URL", help="Also stream spans and metrics over OTLP while attached (http://host:4317 gRPC, http://host:4318 HTTP).")
@click.option("--otlp-protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True, help="OTLP transport for --otlp.")
@click.option("--inject/--no-inject", default=True, show_default=True, help="Inject the vLLM hook into the server's EngineCore and Workers (removed again at the end).")
@click.option("--on-restart", "on_restart", type=click.Choice(["exit", "follow"]), default=None,
              help="When the traced vLLM server's processes are gone: exit (the default: stop cleanly, dataset complete) "
                   "or follow (wait for a vLLM server on the same port, trace its new processes, inject the hook again).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@fabric.options
def command(pids, out, duration, probe_names, no_writes, ringbuf_pages, flush_interval, quiet, sampling, raw_out, port, yes,
            kv_events, kv_replay, metrics_url, metrics_interval, otlp, otlp_protocol, inject, on_restart, command) -> int:
    """Attach kernel probes to processes and record their I/O.

    Trace running processes with --pid, or start one: kvtrace attach --out DIR -- CMD ARGS.
    With neither, find the vLLM server (--port PORT, or --yes for the only one) and trace its
    API server, EngineCore and Workers, plus its KV-event stream and /metrics.
    """
    from kvtrace import targets
    from kvtrace.capture import agg
    from kvtrace.pipeline import Pipeline, default_host, new_run_id

    sampling = agg.parse_mode(sampling)

    if otlp:
        from kvtrace.otlp.exporter import parse_endpoint

        parse_endpoint(otlp, otlp_protocol)  # a bad URL is a usage error, before anything is attached
    if metrics_interval <= 0:
        raise UsageError("--metrics-interval must be a positive number of seconds")
    if kv_replay and not kv_events:
        raise UsageError("--kv-replay needs --kv-events")
    server = None
    if not pids and not command:
        server = choose_server(port, yes)
        pids = tuple(server.pids)
    elif port is not None:
        raise UsageError("--port picks a discovered vLLM server: use it without --pid or a command")
    elif pids and not command:
        server = server_of(pids)  # a pid of a vLLM server picks that whole server
        if server is not None:
            pids = tuple(dict.fromkeys([*pids, *server.pids]))
    if on_restart is not None and server is None:
        raise UsageError("--on-restart applies to a vLLM server: use it with --port, --yes, or --pid of a vLLM server")
    if duration is not None and duration <= 0:
        raise UsageError("--duration must be a positive number of seconds")
    if ringbuf_pages <= 0 or ringbuf_pages & (ringbuf_pages - 1):
        raise UsageError("--ringbuf-pages must be a power of two (e.g. 1024)")
    missing = privileges.missing_for_capture()
    if missing:
        raise PrivilegeError(f"capture needs {', '.join(missing)}: run with sudo (nothing was attached)")
    if tracefs.root() is None:
        raise PrivilegeError("tracefs is not mounted: mount -t tracefs tracefs /sys/kernel/tracing (or run scripts/setup-host)")
    pids = targets.check_pids(list(pids))
    writer = DatasetWriter(out, new_run_id(), default_host())

    from kvtrace.capture.loader import Source

    plan = program.plan(list(probe_names) or None, ringbuf_pages=ringbuf_pages, trace_writes=not no_writes)
    source = Source(plan)
    gated = None
    try:
        if command:
            gated = targets.GatedCommand(list(command))
            pids.append(gated.pid)
        for pid in pids:
            source.add_target(pid)
        raw = open(raw_out, "wb") if raw_out else None
        pipeline = Pipeline(source, plan, writer, pids, command=" ".join(command), raw_out=raw,
                            fresh_pids=(gated.pid,) if gated else ())
        if otlp:
            from kvtrace.otlp.sink import OtlpSink

            pipeline.add_sink(OtlpSink(otlp, otlp_protocol, writer.run, writer.host, pipeline.offset,
                                       lateness_s=2 * flush_interval + 1))
        for name, why in plan.skipped.items():
            if why != "not selected":
                click.echo(f"kvtrace: probe {name} skipped: {why}", err=True)
        for sidecar in start_vllm_streams(server, kv_events, kv_replay, metrics_url, metrics_interval):
            pipeline.add_sidecar(sidecar)
        fabric.start(pipeline, source)  # NVMe topology, NIC counters, nvme/tcp probe settings
        agg.start(pipeline, source, sampling, echo=lambda m: click.echo(m, err=True))  # exact counts, sampling
        click.echo(f"kvtrace: attached {', '.join(plan.attached)} to pid {', '.join(map(str, pids))}; writing {out}", err=True)
        source.start()
        if gated:
            gated.release()
        stop = Stop(duration)
        status = StatusLine(quiet=quiet)
        flag = AgentFlag().__enter__() if "usermark" in plan.attached else None
        injection = inject_hook(server, inject, "usermark" in plan.attached)
        watch = None
        if server is not None and server.port is not None:
            from kvtrace.vllm.restart import ServerWatch

            reinject = (lambda new: inject_hook(new, inject, True)) if injection is not None else None
            watch = ServerWatch(server, on_restart or "exit", source, pipeline, reinject=reinject,
                                echo=lambda m: click.echo(m, err=True), out=out)
            pipeline.add_sidecar(watch)
        next_flush = time.monotonic() + flush_interval
        try:
            while not stop.check(source, watch):
                time.sleep(0.05)
                if time.monotonic() >= next_flush:
                    pipeline.step()
                    next_flush = time.monotonic() + flush_interval
                    t = pipeline.totals
                    status.update(t.total(), t.bytes_read, t.bytes_written, sum(pipeline.lost_by_table().values()), source.dropped)
        except OutputError as e:
            click.echo(f"kvtrace: {e}", err=True)
            raise
        status.done()
        if watch is not None and watch.injection is not None:
            injection = watch.injection   # the server was restarted: the hook is in its new processes
        if injection is not None:
            injection.uninstall()  # the hook flushes its last records on the way out
            time.sleep(0.2)
        if flag:
            flag.__exit__(None, None, None)
        if gated and gated.poll() is None:
            gated.stop()
        pipeline.finish()
    finally:
        for sidecar in pipeline.sidecars if "pipeline" in locals() else ():
            sidecar.close()
        for sink in pipeline.sinks if "pipeline" in locals() else ():
            sink.close()
        source.close()
        if raw_out and "raw" in locals() and raw:
            raw.close()
    for sink in pipeline.sinks:
        click.echo(f"kvtrace: {sink.describe()}", err=True)
    for note in pipeline.notes:
        click.echo(f"kvtrace: warning: {note}", err=True)
    click.echo(f"kvtrace: stopped ({stop.reason}); dataset {out}, run {writer.run}", err=True)
    from kvtrace.commands.summary import print_summary
    from kvtrace.dataset.reader import Dataset

    print_summary(Dataset.open(out), run=writer.run)
    return 0
