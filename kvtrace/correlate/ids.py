"""Trace and span ids, derived from what was recorded so a live run and a later export of its
dataset produce the same ids.

A request that carried a W3C ``traceparent`` keeps that trace id, and kvtrace's request span
becomes a child of the caller's span (a sibling of vLLM's own ``llm_request`` span, whose span
id vLLM draws in the API server when the request finishes, so no other process can know it).
Otherwise the trace id is a hash of (run, engine request id).
"""
from __future__ import annotations

import hashlib
import re

_TP = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: str) -> tuple[bytes, bytes, int] | None:
    """(trace id, parent span id, flags) of a valid W3C traceparent, else None."""
    m = _TP.match((value or "").strip().lower())
    if not m or m.group(1) == "ff":
        return None
    trace, parent = bytes.fromhex(m.group(2)), bytes.fromhex(m.group(3))
    if trace == bytes(16) or parent == bytes(8):
        return None
    if m.group(1) == "00" and m.group(5):
        return None
    return trace, parent, int(m.group(4), 16)


def _h(n: int, *parts) -> bytes:
    h = hashlib.blake2b(digest_size=n)
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\x1f")
    out = h.digest()
    return out if any(out) else b"\x01" + out[1:]


def trace_of(run: str, request: str, traceparent: str = "") -> tuple[bytes, bytes, bool]:
    """(trace id, parent span id of the request span — empty for a root, joined?)."""
    tp = parse_traceparent(traceparent)
    if tp is not None:
        return tp[0], tp[1], True
    return _h(16, b"kvtrace-trace", run, request), b"", False


def request_span(trace: bytes, request: str) -> bytes:
    return _h(8, b"request", trace, request)


def chunk_span(trace: bytes, request: str, attempt: int, step: int) -> bytes:
    return _h(8, b"chunk", trace, request, attempt, step)


def transfer_span(trace: bytes, direction: str, pid: int, tid: int, t_start: int, seq: int) -> bytes:
    return _h(8, b"transfer", trace, direction, pid, tid, t_start, seq)


def io_span(parent: bytes, *key) -> bytes:
    return _h(8, b"io", parent, *key)


def external_id(request: str) -> str:
    """vLLM's external request id (what its llm_request span reports as gen_ai.request.id): the
    engine id without the ``-<8 random chars>`` vLLM appends (vllm/v1/engine/input_processor.py)."""
    head, sep, tail = request.rpartition("-")
    return head if sep and len(tail) == 8 else request
