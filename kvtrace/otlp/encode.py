"""OTLP protobuf encoding of spans, written straight to the wire format.

Building opentelemetry-proto message objects costs ~120 µs a span in Python; this writes the
same bytes (opentelemetry/proto/trace/v1/trace.proto field numbers) at a fraction of that, so
export keeps up with a busy server.  Each span is encoded once, on its own, and the exporter's
queue holds those bytes; a batch is the spans' bytes wrapped in one ResourceSpans/ScopeSpans.
Tests decode what arrives with opentelemetry-proto's own classes.
"""
from __future__ import annotations

import struct

import numpy as np

from kvtrace import __version__

_F64 = struct.Struct("<Q").pack
_D = struct.Struct("<d").pack
_F32 = struct.Struct("<I").pack
_V1 = [bytes([i]) for i in range(128)]
_V2 = [bytes([(i & 0x7F) | 0x80, i >> 7]) for i in range(16384)]
_M64 = (1 << 64) - 1


_V2C = [bytes([(i & 0x7F) | 0x80, ((i >> 7) & 0x7F) | 0x80]) for i in range(16384)]


def varint(n: int) -> bytes:
    if n < 0:
        n &= _M64
    if n < 128:
        return _V1[n]
    if n < 16384:
        return _V2[n]
    out = b""
    while n >= 16384:  # 14 bits per table lookup
        out += _V2C[n & 0x3FFF]
        n >>= 14
    return out + (_V1[n] if n < 128 else _V2[n])


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + varint(len(payload)) + payload


_KEYS: dict[str, bytes] = {}


def _key(k: str) -> bytes:
    b = _KEYS.get(k)
    if b is None:
        kb = k.encode()
        b = _KEYS[k] = b"\x0a" + varint(len(kb)) + kb
    return b


def any_value(v) -> bytes:
    """AnyValue: string 1, bool 2, int 3, double 4."""
    if v is True or v is False:
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _D(v)
    if v is None:
        return b""
    b = str(v).encode()
    return b"\x0a" + varint(len(b)) + b


_KV: dict = {}
_KV_MAX = 65536


def key_value(k: str, v) -> bytes:
    t = type(v)
    cacheable = t is bool or (t is int and -1 < v < 4096) or (t is str and len(v) < 64)
    if cacheable:
        kv = _KV.get((k, t, v))
        if kv is not None:
            return kv
    av = any_value(v)
    kv = _key(k) + b"\x12" + varint(len(av)) + av
    if cacheable and len(_KV) < _KV_MAX:
        _KV[(k, t, v)] = kv
    return kv


def attributes(tag: bytes, attrs) -> bytes:
    out = []
    ap = out.append
    for k, v in attrs:
        kv = key_value(k, v)
        ap(tag)
        ap(varint(len(kv)))
        ap(kv)
    return b"".join(out)


_NAMES: dict[str, bytes] = {}


def span(s) -> bytes:
    """One Span message (without its ScopeSpans field tag): kvtrace.otlp.model.Span -> bytes."""
    name = _NAMES.get(s.name)
    if name is None:
        nb = s.name.encode()
        name = _NAMES[s.name] = b"\x2a" + varint(len(nb)) + nb
    parts = [b"\x0a\x10", s.trace_id, b"\x12\x08", s.span_id]
    if s.trace_state:
        parts.append(_ld(b"\x1a", s.trace_state.encode()))
    if s.parent_id:
        parts += [b"\x22\x08", s.parent_id]
    parts += [name, b"\x30\x01\x39", _F64(s.start), b"\x41", _F64(max(s.end, s.start)),
              attributes(b"\x4a", s.attrs)]
    parts.append(tail(s.events, s.dropped_events, s.error))
    return b"".join(parts)


def tail(events, dropped: int = 0, error: bool = False, trace_state: str = "") -> bytes:
    """The fields after the attributes: events (11), dropped_events_count (12), status (15), and
    trace_state (3) when given (field order does not matter to a protobuf reader)."""
    parts = []
    for t, ename, eattrs in events:
        ev = b"\x09" + _F64(t) + _ld(b"\x12", ename.encode()) + attributes(b"\x1a", eattrs)
        parts.append(_ld(b"\x5a", ev))
    if dropped:
        parts.append(b"\x60" + varint(dropped))
    if error:
        parts.append(_ld(b"\x7a", b"\x18\x02"))  # Status{code: STATUS_CODE_ERROR}
    if trace_state:
        parts.append(_ld(b"\x1a", trace_state.encode()))
    return b"".join(parts)


def event(t: int, name: str, attrs) -> bytes:
    """One Span.Event field (11), tag included."""
    return _ld(b"\x5a", b"\x09" + _F64(t) + _ld(b"\x12", name.encode()) + attributes(b"\x1a", attrs))


_EVICT_HEAD = _ld(b"\x12", b"kvtrace.evict")
_HASH_KV = b"\x1a" + varint(len(key_value("kvtrace.block.hash", "0" * 16))) + key_value("kvtrace.block.hash", "0" * 16)[:-16]


_EV_TAIL: dict = {}


def evict_event(t: int, block_hash: int, block_id: int, group: int, medium: str) -> bytes:
    """The kvtrace.evict event of event(): the same bytes, built from cached pieces."""
    key = (block_id, group, medium)
    tail_ = _EV_TAIL.get(key)
    if tail_ is None:
        tail_ = attributes(b"\x1a", (("kvtrace.block.id", block_id), ("kvtrace.block.group", group),
                                     ("kvtrace.block.medium", medium)))
        if len(_EV_TAIL) < _KV_MAX:
            _EV_TAIL[key] = tail_
    body = b"".join((b"\x09", _F64(t), _EVICT_HEAD, _HASH_KV, b"%016x" % block_hash, tail_))
    return b"\x5a" + varint(len(body)) + body


def resource(attrs) -> bytes:
    return attributes(b"\x0a", attrs)


def scope() -> bytes:
    return _ld(b"\x0a", b"kvtrace") + _ld(b"\x12", __version__.encode())


def trace_request(resource_attrs, encoded_spans: list[bytes]) -> bytes:
    """ExportTraceServiceRequest{resource_spans: [ResourceSpans{resource, scope_spans: [ScopeSpans{scope, spans}]}]}."""
    spans = b"".join(b"\x12" + varint(len(s)) + s for s in encoded_spans)
    ss = _ld(b"\x0a", scope()) + spans
    rs = _ld(b"\x0a", resource(resource_attrs)) + _ld(b"\x12", ss)
    return _ld(b"\x0a", rs)


def resource_attrs(host: str, run: str) -> tuple:
    return (("service.name", "kvtrace"), ("service.version", __version__), ("host.name", host), ("kvtrace.run", run),
            ("telemetry.sdk.name", "kvtrace"), ("telemetry.sdk.language", "python"))


# ---------------------------------------------------------------------------------------------
# Columnar encoding: many spans of one shape (chunk spans, request spans) from numpy columns.
# Each span's bytes are the same as span() writes, assembled with vectorised numpy: a matrix of
# fixed-width pieces per row and a mask of the bytes each row uses.

_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def _varint_matrix(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 10) uint8 varint bytes of int64/uint64 values and their lengths."""
    u = v.astype(np.int64).view(np.uint64) if v.dtype.kind == "i" else v.astype(np.uint64)
    nb = 1 + (u[:, None] >= _LIMITS[None, :]).sum(axis=1)
    g = ((u[:, None] >> _SHIFTS[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    g |= ((np.arange(10)[None, :] < (nb - 1)[:, None]).astype(np.uint8) << 7)
    return g, nb


def _const(b: bytes, n: int) -> np.ndarray:
    return np.broadcast_to(np.frombuffer(b, np.uint8), (n, len(b)))


def _attr_piece(key: str, kind: str, data, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, W) bytes and lengths of attribute field 9 (KeyValue) for every row."""
    kb = key.encode()
    if len(kb) > 100:
        raise ValueError(f"attribute key too long for the columnar encoder: {key}")
    head = b"\x0a" + bytes([len(kb)]) + kb + b"\x12"
    if kind == "i":
        g, nb = _varint_matrix(np.asarray(data))
        m = np.empty((n, 2 + len(head) + 2 + 10), np.uint8)
        m[:, 0] = 0x4A
        m[:, 1] = (len(head) + 2 + nb).astype(np.uint8)  # KeyValue length
        m[:, 2:2 + len(head)] = _const(head, n)
        m[:, 2 + len(head)] = (1 + nb).astype(np.uint8)  # AnyValue length
        m[:, 3 + len(head)] = 0x18
        m[:, 4 + len(head):] = g
        return m, (4 + len(head) + nb).astype(np.int64)
    if kind == "d":
        vals = np.asarray(data, np.float64)
        m = np.empty((n, 2 + len(head) + 2 + 8), np.uint8)
        m[:, 0] = 0x4A
        m[:, 1] = len(head) + 10
        m[:, 2:2 + len(head)] = _const(head, n)
        m[:, 2 + len(head)] = 9
        m[:, 3 + len(head)] = 0x21
        m[:, 4 + len(head):] = vals.view(np.uint8).reshape(n, 8)
        return m, np.full(n, m.shape[1], np.int64)
    if kind == "b":
        codes, (table, lens) = np.asarray(data).astype(np.int64), _piece_table(key, [False, True])
    else:  # "s": (codes, (table, lens)) from _piece_table
        codes, (table, lens) = data
        codes = np.asarray(codes, np.int64)
    return table[codes], lens[codes]


def _piece_table(key: str, values) -> tuple[np.ndarray, np.ndarray]:
    """The attribute field of each distinct value, as a padded matrix and lengths."""
    pieces = [b"\x4a" + varint(len(kv)) + kv for kv in (key_value(key, v) for v in values)]
    w = max(len(p) for p in pieces)
    flat = np.frombuffer(b"".join(pieces), np.uint8)
    lens = np.array([len(p) for p in pieces], np.int64)
    table = np.zeros((len(pieces), w), np.uint8)
    mask = np.arange(w)[None, :] < lens[:, None]
    table[mask] = flat
    return table, lens


def _ids(hexes, width: int) -> np.ndarray:
    n = len(hexes)
    if n == 0:
        return np.zeros((0, width), np.uint8)
    return np.frombuffer(bytes.fromhex("".join(hexes)), np.uint8).reshape(n, width)


def spans_columnar(name: str, trace_hex, span_hex, parent_hex, start: np.ndarray, end: np.ndarray,
                   attrs: list, extra: list | None = None, block: int = 4096) -> list[bytes]:
    """Encode n spans of one name: ids as hex strings ("" parent = root), times as uint64 unix ns,
    attrs = [(key, kind, data)] with kind "i" (integers), "b" (bools), "d" (floats) or "s"
    ((codes, distinct strings)); extra = per-row bytes appended (events, status, trace_state)."""
    n = len(span_hex)
    out: list[bytes] = []
    tables = {key: _piece_table(key, data[1]) for key, kind, data in attrs if kind == "s"}
    attrs = [(key, kind, (np.asarray(data[0], np.int64), None) if kind == "s" else data) for key, kind, data in attrs]
    nb = varint(len(name.encode()))
    name_b = b"\x2a" + nb + name.encode() + b"\x30\x01\x39"
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        k = hi - lo
        has_parent = np.array([bool(p) for p in parent_hex[lo:hi]])
        parents = np.zeros((k, 8), np.uint8)
        if has_parent.any():
            parents[has_parent] = _ids([p for p in parent_hex[lo:hi] if p], 8)
        segs = []
        head = np.empty((k, 38), np.uint8)
        head[:, 0:2] = (0x0A, 0x10)
        head[:, 2:18] = _ids(trace_hex[lo:hi], 16)
        head[:, 18:20] = (0x12, 0x08)
        head[:, 20:28] = _ids(span_hex[lo:hi], 8)
        head[:, 28:30] = (0x22, 0x08)
        head[:, 30:38] = parents
        segs.append((head, np.where(has_parent, 38, 28)))
        tm = np.empty((k, len(name_b) + 17), np.uint8)
        tm[:, :len(name_b)] = _const(name_b, k)
        s = np.asarray(start[lo:hi], np.uint64)
        e = np.maximum(np.asarray(end[lo:hi], np.uint64), s)
        tm[:, len(name_b):len(name_b) + 8] = s.astype("<u8").view(np.uint8).reshape(k, 8)
        tm[:, len(name_b) + 8] = 0x41
        tm[:, len(name_b) + 9:] = e.astype("<u8").view(np.uint8).reshape(k, 8)
        segs.append((tm, np.full(k, tm.shape[1])))
        for key, kind, data in attrs:
            if kind == "s":
                d = (data[0][lo:hi], tables[key])
            else:
                d = np.asarray(data)[lo:hi]
            segs.append(_attr_piece(key, kind, d, k))
        mat = np.concatenate([m for m, _ in segs], axis=1)
        mask = np.concatenate([np.arange(m.shape[1])[None, :] < ln[:, None] for m, ln in segs], axis=1)
        flat = mat[mask].tobytes()
        lens = np.sum([ln for _, ln in segs], axis=0)
        ends = np.cumsum(lens).tolist()
        starts = [0] + ends[:-1]
        rows = [flat[a:b] for a, b in zip(starts, ends)]
        if extra is not None:
            rows = [r + x if x else r for r, x in zip(rows, extra[lo:hi])]
        out += rows
    return out
