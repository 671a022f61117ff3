"""vllm-router (PyPI 0.1.17, in /var/cache/kvtrace/router-venv: scripts/setup-router) in front of
vLLM servers for the fleet tests: replicas under one policy, or a prefill/decode pair."""
from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

from tests.helpers import wait_for
from tests.vllm.conftest import free_port

ROUTER = os.environ.get("KVTRACE_ROUTER_VENV", "/var/cache/kvtrace/router-venv") + "/bin/vllm-router"


class Router:
    """Replicas (``workers``) under ``policy``; with ``pd`` = (prefill, decode), its prefill/decode
    mode over NIXL (``--vllm-pd-disaggregation``) in front of the pair instead."""

    def __init__(self, base: Path, workers: list, policy: str, pd: tuple | None = None):
        self.port = free_port(8400, 8449)
        self.log = base / (f"router-{policy}.log" if pd is None else "pd-router.log")
        where = (["--worker-urls", *[w.url for w in workers]] if pd is None else
                 ["--vllm-pd-disaggregation", "--prefill", pd[0].url, "--decode", pd[1].url, "--kv-connector", "nixl"])
        self.proc = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(self.port), *where,
                                      "--policy", policy, "--log-level", "debug",
                                      "--prometheus-port", str(free_port(8450, 8499))],
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(self._up, 120, "the router")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-2000:]
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
