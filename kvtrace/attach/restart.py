"""A vLLM server restarted while kvtrace is attached (``kvtrace attach --on-restart exit|follow``).

The watch notices that the server's API process is gone (its pid no longer runs, or runs
another program).  With ``exit`` (the default) the capture stops cleanly with one line saying
so: the dataset is finished as on Ctrl-C.  With ``follow`` it says it waits, keeps flushing,
and rediscovers a vLLM server on the same port; once that server answers /health it adds the
new API server, EngineCore and Workers to the kernel probes' target set and injects the hook
again if it had been injected before.  KV events and /metrics need nothing: the subscriber
reconnects by itself and the scraper keeps polling the same URL.

Restarts are recorded in the run row's ``sidecars`` (``{"name": "vllm_server", ...}``).
"""
from __future__ import annotations

import time
import urllib.request

import psutil

from kvtrace.attach import serverset
from kvtrace.capture import fdopen
from kvtrace.host import netns
from kvtrace.servers import discover as found

MODES = ("exit", "follow")


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def healthy(server, timeout: float = 2.0) -> bool:
    url = server.metrics_url
    if not url:
        return True
    def get() -> bool:
        with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/health", timeout=timeout) as r:
            return r.status == 200
    try:
        return bool(netns.call(getattr(server, "netns", None), get, timeout=timeout + 5))
    except (OSError, ValueError):
        return False


class ServerWatch:
    """Sidecar and main-loop helper: ``poll()`` each loop turn returns a stop reason or None."""

    name = "vllm_server"

    def __init__(self, server, mode: str, source, pipeline, reinject=None, echo=None, out: str = "",
                 every_s: float = 0.5, discover=None, clock=time.monotonic):
        self.server = server
        self.port = server.port
        self.mode = mode
        self.source = source
        self.pipeline = pipeline
        self.reinject = reinject      # callable(server) -> injection session or None; None: never inject
        self.echo = echo or (lambda m: None)
        self.out = out
        self.every_s = every_s
        self.clock = clock
        self._discover = discover or found.discover
        self.created = _create_time(server.pid)
        self.state = "attached"
        self.next = 0.0
        self.gone_ns = 0
        self.restarts: list[dict] = []
        self.injection = None         # the session of the latest re-injection

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.server.pid)
            return p.status() != psutil.STATUS_ZOMBIE and (self.created is None or p.create_time() == self.created)
        except psutil.Error:
            return False

    @property
    def waiting(self) -> bool:
        return self.state == "waiting"

    def poll(self) -> str | None:
        now = self.clock()
        if now < self.next:
            return None
        self.next = now + (self.every_s if self.state == "attached" else max(self.every_s, 1.0))
        if self.state == "attached":
            if self.alive():
                return None
            self.gone_ns = time.monotonic_ns()
            where = f"the vLLM server on port {self.port} (pid {self.server.pid})"
            if self.mode == "exit":
                self.echo(f"kvtrace: {where} exited; stopping, the dataset {self.out} is complete up to now "
                          "(--on-restart follow waits for a restart instead)")
                return "vLLM server exited"
            self.echo(f"kvtrace: {where} exited; waiting for a vLLM server on port {self.port} again (--on-restart follow)")
            self.state = "waiting"
            return None
        new = self.find()
        if new is not None:
            self.retarget(new)
        return None

    def find(self):
        """The vLLM server now on the same port, once it serves (its EngineCore is up)."""
        try:
            servers = self._discover()
        except Exception:
            return None
        for s in servers:
            if s.port == self.port and s.pid != self.server.pid and s.engine_pids and healthy(s):
                return s
        return None

    def retarget(self, new) -> None:
        found_ns = time.monotonic_ns()
        for pid in new.pids:
            self.source.add_target(pid)
            fdopen.snapshot(self.pipeline.ctx, pid)
            if pid not in self.pipeline.pids:
                self.pipeline.pids.append(pid)
        old = self.server
        self.server, self.created, self.state = new, _create_time(new.pid), "attached"
        self.pipeline.writer.add("servers", serverset.table([new]))
        injected = []
        if self.reinject is not None:
            self.injection = self.reinject(new)
            if self.injection is not None:
                injected = [r.pid for r in self.injection.results if r.installed]
        self.restarts.append({"gone_ns": self.gone_ns, "found_ns": found_ns, "old_pid": old.pid, "new_pid": new.pid,
                              "pids": list(new.pids), "reinjected": injected})
        roles = f"EngineCore {', '.join(map(str, new.engine_pids))}" + (
            f", Workers {', '.join(map(str, new.worker_pids))}" if new.worker_pids else "")
        self.echo(f"kvtrace: a vLLM server is on port {self.port} again after {(found_ns - self.gone_ns) / 1e9:.1f}s: "
                  f"tracing pid {new.pid} ({roles})" + (f"; hook injected again in {len(injected)} process(es)"
                                                         if self.reinject is not None else ""))

    # ---- sidecar ------------------------------------------------------------------------------
    def drain(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {"port": self.port, "on_restart": self.mode, "state": self.state, "pid": self.server.pid,
                "restarts": self.restarts}

    def close(self) -> None:
        pass
