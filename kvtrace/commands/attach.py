"""`kvtrace attach`: capture the storage I/O of chosen processes into a Parquet dataset."""
from __future__ import annotations

import click

from kvtrace.attach import session
from kvtrace.capture import BY_NAME, program, rawfile
from kvtrace.commands.params import FLUSH_MIN_S, METRICS_MIN_S, Seconds
from kvtrace.dataset.writer import DatasetWriter
from kvtrace.errors import PrivilegeError, UsageError
from kvtrace.attach import fabric, tiers
from kvtrace.host import privileges, tracefs
from kvtrace.attach.select import choose_servers, server_of


@click.command("attach", context_settings={"ignore_unknown_options": False})
@click.option("--pid", "pids", type=int, multiple=True, help="Process to trace (all its threads, and children started later). Repeatable.")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Dataset directory to write (created if missing).")
@click.option("--duration", type=Seconds(), default=None, help="Stop after this many seconds (more than 0).")
@click.option("--probe", "probe_names", multiple=True, type=click.Choice(sorted(BY_NAME)), help="Only these probes (default: all this kernel supports).")
@click.option("--no-writes", is_flag=True, help="Do not trace write system calls.")
@click.option("--skip-nonfile-fds/--trace-nonfile-fds", "skip_fds", default=True, show_default=True,
              help="Let the kernel skip reads and writes on sockets, pipes and eventfds once /proc says a descriptor "
                   "is not a file (far fewer events from a serving process); --trace-nonfile-fds traces them all.")
@click.option("--ringbuf-pages", type=int, default=2048, show_default=True,
              help="Ring buffer size in pages (a power of two; 2048 = 8 MiB, all of it in the agent's RSS).")
@click.option("--flush-interval", type=Seconds(FLUSH_MIN_S), default=1.0, show_default=True,
              help=f"Seconds between Parquet part files, at least {FLUSH_MIN_S:g} (a crash loses the last interval, and a flush under way).")
@click.option("--quiet", is_flag=True, help="No live status line.")
@click.option("--sampling", "sampling", default="auto", show_default=True, metavar="auto|off|N",
              help="Raw block/file/io_uring events: auto samples them (1 in N, each row with its weight) while the ring "
                   "buffer overflows and stops once it keeps up; off never samples (losses are counted); N keeps 1 in N. "
                   "The *_agg tables count every event in the kernel either way.")
@click.option("--raw-out", type=click.Path(dir_okay=False), default=None, help="Also keep the raw ring-buffer records in this file (for bug reports and decoder tests).")
@click.option("--port", "ports", type=int, multiple=True,
              help="Trace the vLLM or SGLang server listening on this port (API server, EngineCore, Workers, and the KV "
                   "tier server its connector reaches).  Repeatable: several servers in one capture (a fleet's replicas).")
@click.option("--all", "all_servers", is_flag=True, help="Trace every vLLM and SGLang server found on this host.")
@click.option("--yes", is_flag=True, help="Without --pid or a command: attach to the only vLLM server found.")
@click.option("--kv-events", "kv_events", default=None, metavar="ENDPOINT", help="vLLM KV-event endpoint as given to vLLM's --kv-events-config (default: from the discovered server).")
@click.option("--kv-replay", "kv_replay", default=None, metavar="ENDPOINT", help="vLLM KV-event replay endpoint, with --kv-events.")
@click.option("--metrics-url", default=None, metavar="URL", help="vLLM Prometheus URL to scrape (default: the discovered server's /metrics).")
@click.option("--metrics-interval", type=Seconds(METRICS_MIN_S), default=30.0, show_default=True,
              help=f"Seconds between /metrics scrapes, at least {METRICS_MIN_S:g} (each costs vLLM's API server about 10 ms "
                   "of CPU; one at attach, one more at stop).")
@click.option("--otlp", "otlp", default=None, metavar="URL", help="Also stream spans and metrics over OTLP while attached (http://host:4317 gRPC, http://host:4318 HTTP).")
@click.option("--otlp-protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True, help="OTLP transport for --otlp.")
@click.option("--inject/--no-inject", default=True, show_default=True, help="Inject the vLLM hook into the server's EngineCore and Workers (removed again at the end).")
@click.option("--on-restart", "on_restart", type=click.Choice(["exit", "follow"]), default=None,
              help="When the traced vLLM server's processes are gone: exit (the default: stop cleanly, dataset complete) "
                   "or follow (wait for a vLLM server on the same port, trace its new processes, inject the hook again).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@fabric.options
def command(pids, out, duration, probe_names, no_writes, skip_fds, ringbuf_pages, flush_interval, quiet, sampling, raw_out, ports,
            all_servers, yes,
            kv_events, kv_replay, metrics_url, metrics_interval, otlp, otlp_protocol, inject, on_restart, command) -> int:
    """Attach kernel probes to processes and record their I/O.

    Trace running processes with --pid, or start one: kvtrace attach --out DIR -- CMD ARGS.
    With neither, find the vLLM server (--port PORT, or --yes for the only one) and trace its
    API server, EngineCore and Workers, plus its KV-event stream and /metrics, and the KV tier
    servers its connector reaches (LMCache's).
    """
    from kvtrace.capture import agg  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    sampling = agg.parse_mode(sampling)
    _check_options(otlp, otlp_protocol, kv_events, kv_replay, ringbuf_pages)
    servers, pids = _targets(pids, command, ports, all_servers, yes)
    if len(servers) > 1 and (kv_events or metrics_url):
        raise UsageError("--kv-events and --metrics-url name one server's streams: with several servers each one's "
                         "are found by discovery (leave them out)")
    found_tiers = [t for s in servers for t in tiers.follow(s, echo=lambda m: click.echo(m, err=True))]
    pids = tuple(dict.fromkeys([*pids, *(p for t in found_tiers for p in t.pids)]))
    if on_restart is not None and not servers:
        raise UsageError("--on-restart applies to a vLLM server: use it with --port, --yes, or --pid of a vLLM server")
    _check_privileges()
    writer, pids = _start_dataset(out, pids, raw_out)
    plan = program.plan(list(probe_names) or None, ringbuf_pages=ringbuf_pages, trace_writes=not no_writes,
                        skip_fds=skip_fds)
    cap = session.Capture(plan, writer, pids, out, list(command), servers, duration, flush_interval, sampling, raw_out,
                          otlp, otlp_protocol, kv_events, kv_replay, metrics_url, metrics_interval, inject,
                          on_restart, quiet, found_tiers)
    pipeline, reason = session.run(cap, echo=lambda m: click.echo(m, err=True))
    _report(pipeline, reason, out, writer.run)
    return 0


def _check_options(otlp, otlp_protocol, kv_events, kv_replay, ringbuf_pages) -> None:
    """Usage errors found from the options alone, before anything is looked up or attached."""
    if otlp:
        from kvtrace.otlp.exporter import parse_endpoint  # lazy: start-up cost: the CLI imports every command's module (cli._register)

        parse_endpoint(otlp, otlp_protocol)  # a bad URL is a usage error, before anything is attached
    if kv_replay and not kv_events:
        raise UsageError("--kv-replay needs --kv-events")
    if ringbuf_pages <= 0 or ringbuf_pages & (ringbuf_pages - 1):
        raise UsageError("--ringbuf-pages must be a power of two (e.g. 1024)")


def _targets(pids, command, ports, all_servers, yes):
    """(the servers traced: none, one or several, the pids to trace)."""
    servers = []
    if not pids and not command:
        servers = choose_servers(list(ports), all_servers, yes)
        pids = tuple(p for s in servers for p in s.pids)
    elif ports or all_servers:
        raise UsageError("--port and --all pick discovered servers: use them without --pid or a command")
    elif pids and not command:
        server = server_of(pids)  # a pid of a vLLM server picks that whole server
        if server is not None:
            servers = [server]
            pids = tuple(dict.fromkeys([*pids, *server.pids]))
    return servers, pids


def _check_privileges() -> None:
    missing = privileges.missing_for_capture()
    if missing:
        raise PrivilegeError(f"capture needs {', '.join(missing)}: run with sudo (nothing was attached)")
    if tracefs.root() is None:
        raise PrivilegeError("tracefs is not mounted: mount -t tracefs tracefs /sys/kernel/tracing (or run scripts/setup-host)")


def _start_dataset(out, pids, raw_out):
    """The pids checked, the dataset's writer made and the --raw-out file created (0600)."""
    from kvtrace.attach import targets  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.attach.pipeline import default_host, new_run_id  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    pids = targets.check_pids(list(pids))
    writer = DatasetWriter(out, new_run_id(), default_host())
    if raw_out:
        rawfile.create(raw_out).close()  # not writable: one line, exit 5, nothing attached
    return writer, pids


def _report(pipeline, reason: str, out, run: str) -> None:
    """The sinks, warnings and stop line, then the summary of what was recorded."""
    from kvtrace.commands.summary import print_summary  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.dataset.reader import Dataset  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    for sink in pipeline.sinks:
        click.echo(f"kvtrace: {sink.describe()}", err=True)
    for note in pipeline.notes:
        click.echo(f"kvtrace: warning: {note}", err=True)
    click.echo(f"kvtrace: stopped ({reason}); dataset {out}, run {run}", err=True)
    print_summary(Dataset.open(out), run=run)
