"""A real vLLM CPU server with the kvtrace hook installed (module-scoped), and a subscriber to
its ZMQ KV-event stream that keeps every batch with its arrival time."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtrace.demo.server import VllmServer, vllm_python
from tests import helpers

BLOCK_SIZE = 32
SERVER_ARGS = [
    "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching", "--max-num-batched-tokens", "256",
    "--kv-cache-memory-bytes", "8000000", "--enable-prompt-tokens-details",
    # VllmServer sets VLLM_CPU_KVCACHE_SPACE=1 (GiB), which overrides --kv-cache-memory-bytes:
    # pin the block count instead (122 = the null block + 121 usable, 3,872 tokens).
    "--num-gpu-blocks-override", "122", "--max-model-len", "2048",
]


def vllm_skip_reason() -> str | None:
    py = vllm_python()
    reason = helpers.engine_venv_skip_reason(py, "vLLM", "vllm.general_plugins")
    if reason and not Path(py).exists():
        return f"{reason}; set KVTRACE_VLLM_PYTHON"
    return reason


def prefix_caching(*extra: str, block: int = 32, budget: int = 256, max_len: int = 2048) -> list[str]:
    """vLLM's arguments for the configuration tests: prefix caching with each response's cached
    tokens, ``block``-token blocks, a ``budget``-token chunk budget, then ``extra``."""
    return ["--block-size", str(block), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-num-batched-tokens", str(budget), "--max-model-len", str(max_len), *extra]


@contextlib.contextmanager
def served(base: Path, args: list[str], ports: tuple[int, int] = (8300, 8349), env: dict | None = None,
           timeout: float = 600, model: str = "tiny"):
    """A vLLM server (plugins off: the agent injects the hook) in ``base``/server, started,
    stopped on the way out; the test skips where vLLM's venv is missing."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    srv = VllmServer(args=args, port=free_port(*ports), env={"VLLM_PLUGINS": "", **(env or {})},
                     workdir=base / "server", model_name=model)
    srv.start(timeout=timeout)
    try:
        yield srv
    finally:
        srv.stop()


def free_port(lo: int = 8100, hi: int = 8199, avoid: tuple[int, ...] = ()) -> int:
    """A free 127.0.0.1 port in [lo, hi] (the range these tests may use)."""
    return helpers.free_port(lo, hi, avoid)


@dataclass
class KvEventSink:
    """SUB socket bound on 127.0.0.1 (vLLM's publisher connects to a non-wildcard endpoint), or,
    with ``connect``, connected to a publisher that vLLM bound; with ``netns``
    (/proc/PID/ns/net) the socket lives in that network namespace."""

    port: int
    batches: list = field(default_factory=list)  # (recv monotonic ns, seq, [ts, events, dp_rank])
    connect: bool = False
    netns: str | None = None

    def start(self) -> "KvEventSink":
        import msgspec

        self._decode = msgspec.msgpack.decode
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the KV-event sink did not start"
        if self._error is not None:
            raise self._error
        return self

    def _open(self) -> None:
        import zmq

        if self.netns:
            from kvtrace.host import netns

            netns.enter(self.netns)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        address = f"tcp://127.0.0.1:{self.port}"
        self._sub.connect(address) if self.connect else self._sub.bind(address)

    def _run(self) -> None:
        try:
            self._open()
        except BaseException as e:   # raised again by start()
            self._error = e
            return
        finally:
            self._ready.set()
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            parts = self._sub.recv_multipart()
            if len(parts) == 3:
                self.batches.append((time.monotonic_ns(), int.from_bytes(parts[1], "big"), self._decode(parts[2])))

    def between(self, t0_ns: int, t1_ns: int) -> list:
        return [b for b in list(self.batches) if t0_ns <= b[0] <= t1_ns]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._ctx.term()


@dataclass
class HookedServer:
    server: VllmServer
    events: KvEventSink

    def post(self, prompt: list[int], request_id: str, max_tokens: int = 4, **extra) -> dict:
        return helpers.post_completion(self.server.url, self.server.model, prompt, request_id, max_tokens,
                                       return_token_ids=True, **extra)


@pytest.fixture(scope="module")
def hooked_server(tmp_path_factory):
    """vLLM with the kvtrace plugin (nothing to enable: it loads from the entry point)."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("zmq", reason="needs pyzmq in kvtrace's venv to read vLLM's KV events")
    pytest.importorskip("msgspec", reason="needs msgspec in kvtrace's venv to decode vLLM's KV events")
    zport = free_port()
    events = KvEventSink(zport).start()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    server = VllmServer(
        args=[*SERVER_ARGS, "--kv-events-config", json.dumps(kv_events)],
        port=free_port(avoid=(zport,)),
        workdir=tmp_path_factory.mktemp("vllm"),
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /pause and /resume, to queue a burst at once
    )
    try:
        server.start()
    except Exception:
        events.close()
        raise
    try:
        yield HookedServer(server, events)
    finally:
        server.stop()
        events.close()
