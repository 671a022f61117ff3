"""`kvtrace attach`: capture the storage I/O of chosen processes into a Parquet dataset."""
from __future__ import annotations

import signal
import time

import click

from kvtrace.agentflag import AgentFlag
from kvtrace.capture import BY_NAME, program
from kvtrace.dataset.writer import DatasetWriter
from kvtrace.errors import OutputError, PrivilegeError, UsageError
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

    def check(self, source) -> str | None:
        if self.reason:
            return self.reason
        if self.deadline and time.monotonic() >= self.deadline:
            self.reason = "duration"
        elif not source.targets():
            self.reason = "all traced processes exited"
        return self.reason


@click.command("attach", context_settings={"ignore_unknown_options": False})
@click.option("--pid", "pids", type=int, multiple=True, help="Process to trace (all its threads, and children started later). Repeatable.")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Dataset directory to write (created if missing).")
@click.option("--duration", type=float, default=None, help="Stop after this many seconds.")
@click.option("--probe", "probe_names", multiple=True, type=click.Choice(sorted(BY_NAME)), help="Only these probes (default: all this kernel supports).")
@click.option("--no-writes", is_flag=True, help="Do not trace write system calls.")
@click.option("--ringbuf-pages", type=int, default=1024, show_default=True, help="Ring buffer size in pages (a power of two).")
@click.option("--flush-interval", type=float, default=1.0, show_default=True, help="Seconds between Parquet part files (a crash loses at most this much).")
@click.option("--quiet", is_flag=True, help="No live status line.")
@click.option("--raw-out", type=click.Path(dir_okay=False), default=None, help="Also keep the raw ring-buffer records in this file (for bug reports and decoder tests).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def command(pids, out, duration, probe_names, no_writes, ringbuf_pages, flush_interval, quiet, raw_out, command) -> int:
    """Attach kernel probes to processes and record their I/O.

    Trace running processes with --pid, or start one: kvtrace attach --out DIR -- CMD ARGS.
    """
    from kvtrace import targets
    from kvtrace.pipeline import Pipeline, default_host, new_run_id

    if not pids and not command:
        raise UsageError("nothing to trace: give --pid PID, or a command after -- (kvtrace attach --out DIR -- CMD)")
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
        pipeline = Pipeline(source, plan, writer, pids, command=" ".join(command), raw_out=raw)
        for name, why in plan.skipped.items():
            if why != "not selected":
                click.echo(f"kvtrace: probe {name} skipped: {why}", err=True)
        click.echo(f"kvtrace: attached {', '.join(plan.attached)} to pid {', '.join(map(str, pids))}; writing {out}", err=True)
        if gated:
            gated.release()
        stop = Stop(duration)
        status = StatusLine(quiet=quiet)
        flag = AgentFlag().__enter__() if "usermark" in plan.attached else None
        next_flush = time.monotonic() + flush_interval
        try:
            while not stop.check(source):
                source.poll(100)
                if time.monotonic() >= next_flush:
                    pipeline.step()
                    next_flush = time.monotonic() + flush_interval
                    t = pipeline.totals
                    status.update(t.total(), t.bytes_read, t.bytes_written, sum(pipeline.lost_by_table().values()), source.dropped)
        except OutputError as e:
            click.echo(f"kvtrace: {e}", err=True)
            raise
        status.done()
        if flag:
            flag.__exit__(None, None, None)
        if gated and gated.poll() is None:
            gated.stop()
        pipeline.finish()
    finally:
        source.close()
        if raw_out and "raw" in locals() and raw:
            raw.close()
    click.echo(f"kvtrace: stopped ({stop.reason}); dataset {out}, run {writer.run}", err=True)
    from kvtrace.commands.summary import print_summary
    from kvtrace.dataset.reader import Dataset

    print_summary(Dataset.open(out), run=writer.run)
    return 0
