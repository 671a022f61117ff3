"""Helpers shared by the benchmarks that drive a real vLLM CPU server (bench/overhead.py,
bench/attach.py): ports, prefix-cache reset, one timed round of a workload, `kvtrace attach`
as a measured subprocess, and a ratio's spread."""
from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtrace.demo import workload  # noqa: E402
from kvtrace.demo.server import VllmServer  # noqa: E402
from stream import CONCURRENCY, requests  # noqa: E402,F401  (the benchmarks' request stream)

PY = sys.executable
PORTS = range(8600, 8700)


def free_port(avoid=()) -> int:
    for p in PORTS:
        if p in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p
    raise RuntimeError("no free port in 8600-8699")


def reset_cache(server: VllmServer) -> None:
    """POST /reset_prefix_cache (the server needs VLLM_SERVER_DEV_MODE=1)."""
    req = urllib.request.Request(f"{server.url}/reset_prefix_cache", method="POST", data=b"")
    urllib.request.urlopen(req, timeout=60).read()


def one_round(server: VllmServer, reqs, concurrency: int) -> dict:
    """Reset the prefix cache, send reqs at this concurrency; tokens/s, TTFT p50, errors."""
    reset_cache(server)
    t0 = time.monotonic()
    results = workload.run(server.url, server.model, reqs, concurrency=concurrency)
    wall = time.monotonic() - t0
    errors = [r.error for r in results if r.error]
    tokens = sum(r.completion_tokens for r in results)
    ttft = sorted(r.ttft_s for r in results if r.t_first_ns)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttft),
            "errors": len(errors), "cached_tokens": sum(r.cached_tokens for r in results)}


def spread(xs: list[float]) -> dict:
    return {"mean": round(statistics.fmean(xs), 4), "median": round(statistics.median(xs), 4),
            "min": round(min(xs), 4), "max": round(max(xs), 4),
            "stdev": round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0}


def kvtrace_importable_env() -> dict[str, str]:
    """Environment for a vLLM server that must import kvtrace (its plugin, its KV connector)
    from this checkout, whatever the vLLM venv's own install of kvtrace points at."""
    return {"PYTHONPATH": str(ROOT)}


class Agent:
    """`kvtrace attach --quiet --port P` (plus ``extra`` options) as a subprocess; returns once
    the hook is active in the engine (or, with ``ready``, once a line containing it arrived).
    Every stderr line is kept with its arrival time (CLOCK_MONOTONIC ns); RSS and CPU sampled
    on demand."""

    def __init__(self, server: VllmServer, out: Path, otlp_url: str | None = None, extra: list[str] = (),
                 env: dict[str, str] | None = None, ready=None, start_timeout: float | None = None):
        cmd = [PY, "-m", "kvtrace", "attach", "--quiet", "--port", str(server.port), "--out", str(out), *extra]
        if otlp_url:
            cmd += ["--otlp", otlp_url]
        ready = ready or (lambda line: "vLLM hook" in line and "engine" in line)
        self.t_launch_ns = time.monotonic_ns()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.stamped: list[tuple[int, str]] = []
        # start_timeout: an agent that is not ready by then (e.g. stuck injecting) is killed
        watchdog = threading.Timer(start_timeout, self.proc.kill) if start_timeout else None
        if watchdog is not None:
            watchdog.start()
        try:
            for line in self.proc.stderr:
                self._keep(line)
                if ready(line):
                    break
            else:
                self.proc.wait(30)
                why = f"killed, not ready after {start_timeout:g} s" if self.proc.returncode == -9 else f"exit {self.proc.returncode}"
                raise RuntimeError(f"kvtrace attach did not get ready ({why}): " + "".join(self.lines)[-2000:])
        finally:
            if watchdog is not None:
                watchdog.cancel()
        self.ps = psutil.Process(self.proc.pid)
        self.rss: list[int] = []
        self._stop = threading.Event()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _keep(self, line: str) -> None:
        self.stamped.append((time.monotonic_ns(), line))
        self.lines.append(line)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self._keep(line)

    def wait_line(self, pred, timeout: float) -> tuple[int, str] | None:
        """The first stderr line matching pred (waiting up to timeout s), with its arrival time."""
        deadline = time.monotonic() + timeout
        while True:
            for t, line in list(self.stamped):
                if pred(line):
                    return t, line
            if time.monotonic() > deadline or self.proc.poll() is not None and not self._drainer.is_alive():
                return None
            time.sleep(0.02)

    def sample(self) -> None:
        def run():
            while not self._stop.is_set():
                try:
                    self.rss.append(self.ps.memory_info().rss)
                except psutil.Error:
                    return
                self._stop.wait(0.2)

        self._stop.clear()
        threading.Thread(target=run, daemon=True).start()

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self, timeout: float = 300.0) -> bool:
        """SIGINT, as Ctrl-C; False when the agent had not exited after timeout s (it is then killed)."""
        self._stop.set()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return False
        self._drainer.join(10)
        return True
