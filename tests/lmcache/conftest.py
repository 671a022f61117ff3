"""LMCache 0.5.6 in multiprocess mode on the CPU: its cache server (`python -m
lmcache.v1.multiprocess.server`, L1 in memory, the `fs` L2 adapter in a test directory) and a
real vLLM server whose LMCacheMPConnector talks to it over ZeroMQ, both from the venv
scripts/setup-lmcache makes beside vLLM's (module-scoped: each start costs about a minute).

A test module chooses the server's L2 store policy with ``LMCACHE_L2_STORE_POLICY`` ("default":
keep stored chunks in L1 as well; "skip_l1": drop them from L1 once on disk, so every load is
read back from the L2 files).  The L2 adapter opens its files with O_DIRECT, so what the server
reads back shows in its /proc/PID/io read_bytes (a page-cache hit would not).  LMCache's own
metrics (Prometheus text) are on ``LmcacheServer.metrics_url``."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtrace.demo.server import VllmServer
from tests.helpers import wait_for
from tests.vllm.conftest import free_port, vllm_skip_reason

DEFAULT_VENV = "/var/cache/kvtrace/lmcache-venv"
VERSION = "0.5.6"
CHUNK = 256          # LMCache's chunk (tokens): what it stores and loads, one L2 file per chunk
BLOCK = 32           # vLLM's block (the CPU backend needs a multiple of 32)
# LMCache reports usage to its own collector unless told not to
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def lmcache_python() -> str:
    return os.path.join(os.environ.get("KVTRACE_LMCACHE_VENV") or DEFAULT_VENV, "bin", "python")


def lmcache_skip_reason() -> str | None:
    py = lmcache_python()
    if not Path(py).exists():
        return f"needs the LMCache venv ({py}): bash scripts/setup-lmcache (make setup-lmcache)"
    probe = ("import sys, importlib.util as u; from importlib.metadata import version;"
             f"sys.exit(0 if version('lmcache') == {VERSION!r} and u.find_spec('vllm') else 3)")
    r = subprocess.run([py, "-c", probe], capture_output=True, timeout=60)
    if r.returncode:
        return (f"the LMCache venv ({py}) lacks lmcache {VERSION} or does not see vLLM: bash scripts/setup-lmcache; "
                + r.stderr.decode(errors="replace")[-300:])
    return vllm_skip_reason()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class LmcacheServer:
    """LMCache's multiprocess cache server on 127.0.0.1:port (ZeroMQ), its L2 in ``l2_dir``."""

    python: str
    port: int
    prometheus_port: int
    l2_dir: Path
    log_path: Path
    store_policy: str = "default"
    l1_size_gb: float = 0.25
    chunk_size: int = CHUNK
    odirect: bool = True
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def command(self) -> list[str]:
        l2 = {"type": "fs", "base_path": str(self.l2_dir), "use_odirect": self.odirect}
        return [self.python, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(self.port),
                "--chunk-size", str(self.chunk_size), "--supported-transfer-mode", "auto",
                "--l1-size-gb", str(self.l1_size_gb), "--eviction-policy", "LRU",
                "--l2-store-policy", self.store_policy, "--l2-adapter", json.dumps(l2),
                "--prometheus-port", str(self.prometheus_port)]

    def start(self, timeout: float = 120.0) -> "LmcacheServer":
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(LMCACHE_ENV)
        self.proc = subprocess.Popen(self.command(), stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     env=env, cwd=self.log_path.parent, start_new_session=True)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the LMCache server exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log()[-3000:])
            return "LMCache cache server is running..." in self.log() and _listening(self.port)

        try:
            wait_for(up, timeout, f"the LMCache server to listen on {self.port} (log {self.log_path})", step=0.5)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def log(self) -> str:
        """The server's log so far, without its colour codes."""
        try:
            return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))
        except OSError:
            return ""

    def io(self) -> dict[str, int]:
        """The server process's /proc/PID/io counters (read_bytes: what it read from a device)."""
        out = {}
        for line in Path(f"/proc/{self.pid}/io").read_text().splitlines():
            k, v = line.split(":")
            out[k] = int(v)
        return out

    def l2_files(self) -> dict[str, int]:
        """The L2 adapter's chunk files (``*.data``) and their sizes."""
        return {p.name: p.stat().st_size for p in self.l2_dir.rglob("*.data") if p.is_file()}

    def stop(self) -> None:
        """SIGINT (its KeyboardInterrupt path: "Shutting down server...", adapters closed)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def lmcache_server(request, tmp_path_factory):
    reason = lmcache_skip_reason()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("lmcache")
    port = free_port()
    srv = LmcacheServer(python=lmcache_python(), port=port, prometheus_port=free_port(avoid=(port,)),
                        l2_dir=work / "l2", log_path=work / "lmcache-server.log",
                        store_policy=getattr(request.module, "LMCACHE_L2_STORE_POLICY", "default"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def lmcache_vllm(lmcache_server, tmp_path_factory):
    """vLLM (the LMCache venv's interpreter, which sees vLLM's venv) with LMCacheMPConnector on
    ``lmcache_server``: 32-token blocks, prefix caching, a 256-token chunk budget, a 122-block
    cache, cached tokens in each response's usage, /reset_prefix_cache (dev mode), no kvtrace
    plugin (`kvtrace attach` injects the hook)."""
    connector = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                               "lmcache.mp.port": lmcache_server.port}}
    taken = (lmcache_server.port, lmcache_server.prometheus_port)
    server = VllmServer(
        args=["--block-size", str(BLOCK), "--enable-prefix-caching", "--enable-prompt-tokens-details",
              "--max-num-batched-tokens", "256", "--num-gpu-blocks-override", "122", "--max-model-len", "2048",
              "--kv-transfer-config", json.dumps(connector)],
        python=lmcache_server.python,
        port=free_port(avoid=taken),
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_PLUGINS": "", **LMCACHE_ENV},
        workdir=tmp_path_factory.mktemp("lmcache-vllm"),
    )
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    try:
        yield server
    finally:
        server.stop()
