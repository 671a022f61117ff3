"""A tiny API for code running inside the server (e.g. vLLM's KV connector) to report its own transfers.

    from kvtrace.hook import api
    api.kv_transfer("load", request_id, blocks, nbytes, t_start_ns, t_end_ns)

Times are CLOCK_MONOTONIC ns (``time.monotonic_ns()``).  ``blocks`` is a count or a sequence.
Becomes a ``kv_load`` / ``kv_store`` record when the hook (kvtrace.hook.vllm.hook) is installed
in this process and an agent is attached; otherwise a no-op.  Never raises, never blocks.
Standard library only.
"""
from __future__ import annotations

# Set by kvtrace.hook.vllm.hook.install(); None while the hook is not installed.
_sink = None


def kv_transfer(direction: str, request_id: str, blocks, nbytes: int, t_start_ns: int, t_end_ns: int,
                *, source: str = "") -> None:
    """Record one KV transfer: direction "load" (into the KV cache) or "store" (out of it)."""
    sink = _sink
    if sink is None:
        return
    try:
        sink(direction, request_id, blocks, nbytes, t_start_ns, t_end_ns, source)
    except Exception:
        pass


def installed() -> bool:
    return _sink is not None
