"""One capture from start to stop: the stages wired (source → decode → correlate → sinks),
the sidecars started, the vLLM hook injected, the flush loop, and a clean stop that keeps
everything already captured.  ``kvtrace attach`` checks its options and calls ``run``."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from kvtrace.attach.agentflag import AgentFlag
from kvtrace.host.confined import UnsafePath
from kvtrace.capture import agg, fdskip, rawfile
from kvtrace.errors import OutputError
from kvtrace.attach import fabric
from kvtrace.attach.status import StatusLine


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
        """``watch``: the vLLM server's watch (kvtrace.attach.restart), which decides what its
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


@dataclass
class Capture:
    """What to capture and where to: ``kvtrace attach``'s checked options."""
    plan: object                     # kvtrace.capture.program.Plan
    writer: object                   # kvtrace.dataset.writer.DatasetWriter
    pids: list[int]
    out: str
    command: list[str] = field(default_factory=list)
    servers: list = field(default_factory=list)   # kvtrace.servers.info.ServerInfo: one, or a host's several
    duration: float | None = None
    flush_interval: float = 1.0
    sampling: object = "auto"
    raw_out: str | None = None
    otlp: str | None = None
    otlp_protocol: str = "grpc"
    kv_events: str | None = None
    kv_replay: str | None = None
    metrics_url: str | None = None
    metrics_interval: float = 30.0  # a scrape costs the API server about 10 ms of CPU (docs/performance.md)
    inject: bool = True
    on_restart: str | None = None
    quiet: bool = False
    tiers: list = field(default_factory=list)   # kvtrace.servers.tier.TierInfo: traced with the server


def run(cap: Capture, echo) -> tuple[object, str]:
    """Capture until stopped; returns (pipeline, why it stopped).  ``echo`` prints one line."""
    from kvtrace.attach import targets  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.capture import memory  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.capture.loader import Source  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.attach.pipeline import Pipeline  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.attach.streams import start_vllm_streams  # lazy: start-up cost: the CLI imports attach's options for every command

    from kvtrace.attach import serverset  # lazy: start-up cost: the CLI imports attach's options for every command

    plan, writer, servers = cap.plan, cap.writer, cap.servers
    if servers:   # the run row names the server kind and version discovery found (none, or differing: null)
        writer.state_server(*serverset.stated(servers))
        writer.add("servers", serverset.table(servers))
    if cap.tiers:
        from kvtrace.attach.tiers import table  # lazy: start-up cost: the CLI imports attach's options for every command

        writer.add("tiers", table(cap.tiers))
    pids = list(cap.pids)
    source = Source(plan)
    gated = pipeline = raw = None
    try:
        if cap.command:
            gated = targets.GatedCommand(list(cap.command))
            pids.append(gated.pid)
        for pid in pids:
            source.add_target(pid)
        raw = rawfile.create(cap.raw_out) if cap.raw_out else None
        pipeline = Pipeline(source, plan, writer, pids, command=" ".join(cap.command), raw_out=raw,
                            fresh_pids=(gated.pid,) if gated else (), release_startup=memory.trimming())
        fdskip.start(pipeline, source, list(cap.pids))   # sockets, pipes, eventfds: skipped in the kernel
        if cap.otlp:
            from kvtrace.otlp.sink import OtlpSink  # lazy: start-up cost: the CLI imports attach's options for every command

            sink = OtlpSink(cap.otlp, cap.otlp_protocol, writer.run, writer.host, pipeline.offset,
                            lateness_s=2 * cap.flush_interval + 1)
            if cap.tiers:   # the tier's chunk size, for the miss causes of the live spans
                sink.consume({"tiers": table(cap.tiers)})
            pipeline.add_sink(sink)
        for name, why in plan.skipped.items():
            if why != "not selected":
                echo(f"kvtrace: probe {name} skipped: {why}")
        for server in servers or [None]:
            for sidecar in start_vllm_streams(server, cap.kv_events, cap.kv_replay, cap.metrics_url,
                                              cap.metrics_interval, echo=echo, pids=pids):
                pipeline.add_sidecar(serverset.Tagged(sidecar, server.port if server is not None else 0))
        if cap.tiers:
            from kvtrace.attach.tiers import scrapers  # lazy: start-up cost: the CLI imports attach's options for every command

            for sidecar in scrapers(cap.tiers, cap.metrics_interval, echo):
                pipeline.add_sidecar(sidecar)
        fabric.start(pipeline, source)  # NVMe topology, NIC counters, nvme/tcp probe settings
        agg.start(pipeline, source, cap.sampling, echo=echo)  # exact counts, sampling
        echo(f"kvtrace: attached {', '.join(plan.attached)} to pid {', '.join(map(str, pids))}; writing {cap.out}")
        source.start()
        if gated:
            gated.release()
        stop = Stop(cap.duration)
        reason = _loop(cap, source, pipeline, servers, stop, gated, echo)
        pipeline.finish()
    finally:
        for sidecar in pipeline.sidecars if pipeline is not None else ():
            if hasattr(sidecar, "close"):   # optional (Pipeline.add_sidecar)
                sidecar.close()
        for sink in pipeline.sinks if pipeline is not None else ():
            sink.close()
        source.close()
        if raw:
            raw.close()
    return pipeline, reason


def _verdict(server, cap: Capture) -> dict | None:
    """The hook's checks of the server's vLLM files, before anything is injected."""
    if server is None or not cap.inject:
        return None
    from kvtrace.servers import hooksupport  # lazy: start-up cost: the CLI imports attach's options for every command

    return hooksupport.verdict(server)


def _tier_hooks(cap: Capture, usermark: bool, echo, flag):
    """The hooks in the KV tier servers the engine's connector reaches (kvtrace.attach.tiers)."""
    if not cap.tiers:
        return None
    from kvtrace.attach.tiers import inject  # lazy: start-up cost: the CLI imports attach's options for every command

    return inject(cap.tiers, cap.inject, usermark, echo, flag)


def _flag(usermark: bool, echo) -> AgentFlag | None:
    """The agent's flag for the hook, or None (said why) where its directory cannot be trusted."""
    if not usermark:
        return None
    try:
        return AgentFlag().__enter__()
    except UnsafePath as e:
        echo(f"kvtrace: {e}; no hook this run (it sends records only while an agent's flag is there)")
        return None


def _inject(cap: Capture, server, usermark: bool, echo, flag):
    from kvtrace.inject.session import inject_hook  # lazy: start-up cost: the CLI imports attach's options for every command

    return inject_hook(server, cap.inject, usermark, echo, flag, checked=_verdict(server, cap))


def _watches(cap: Capture, servers: list, injections: list, source, pipeline, echo, flag):
    """One restart watch per server that listens on a port (kvtrace.attach.restart), as one."""
    from kvtrace.attach.restart import ServerWatch  # lazy: start-up cost: the CLI imports attach's options for every command
    from kvtrace.attach.serverset import Watches  # lazy: start-up cost: the CLI imports attach's options for every command

    watches = []
    for server, injection in zip(servers, injections):
        if server.port is None:
            watches.append(None)
            continue
        reinject = (lambda new: _inject(cap, new, True, echo, flag)) if injection is not None else None
        w = ServerWatch(server, cap.on_restart or "exit", source, pipeline, reinject=reinject, echo=echo, out=cap.out)
        pipeline.add_sidecar(w)
        watches.append(w)
    return Watches(watches) if any(watches) else None


def _loop(cap: Capture, source, pipeline, servers: list, stop: Stop, gated, echo) -> str:
    """Flush every ``flush_interval`` until ``stop`` says why; then take the hooks out."""
    status = StatusLine(quiet=cap.quiet)
    usermark = "usermark" in cap.plan.attached
    flag = _flag(usermark, echo)
    usermark = flag is not None
    injections = [_inject(cap, server, usermark, echo, flag) for server in servers]
    tier_hooks = _tier_hooks(cap, usermark, echo, flag)
    watch = _watches(cap, servers, injections, source, pipeline, echo, flag)
    next_flush = time.monotonic() + cap.flush_interval
    try:
        while not stop.check(source, watch):
            time.sleep(0.05)
            if time.monotonic() >= next_flush:
                pipeline.step()
                # flush starts a fixed interval apart (a slow flush does not push the next one
                # back), so a crash loses one interval and the flush under way; but at least half
                # an interval of rest after a flush that overran
                next_flush = max(next_flush + cap.flush_interval, time.monotonic() + cap.flush_interval / 2)
                t = pipeline.totals
                status.update(t.total(), t.bytes_read, t.bytes_written, sum(pipeline.lost_by_table().values()), source.dropped)
        status.done()
    except OutputError:   # kvtrace.cli prints it, once
        status.done()
        raise
    finally:   # also when writing failed: the server must not keep a hook for a dead capture
        if watch is not None:   # a restarted server: the hook is in its new processes
            injections = [new or old for new, old in zip(watch.injections(), injections)]
        if tier_hooks is not None:
            tier_hooks.uninstall()
        for injection in injections:
            if injection is not None:
                injection.uninstall()  # the hook flushes its last records on the way out
        if any(i is not None for i in injections) or tier_hooks is not None:
            time.sleep(0.2)
        if flag:
            flag.__exit__(None, None, None)
    if gated and gated.poll() is None:
        gated.stop()   # a command kvtrace started ends with the capture (not when writing failed)
    return stop.reason
