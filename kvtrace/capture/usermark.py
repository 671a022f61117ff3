"""Decoder for probes/usermark.bpf.c: frames from the hook inside vLLM, split into records
(kvtrace.hook.wire) and returned as one Arrow table per record type."""
from __future__ import annotations

import struct

import pyarrow as pa

from kvtrace.capture.events import HEADER, KIND_USER, DecodeContext, struct_dtype
from kvtrace.hook.wire import CODEC, MAGIC, evict_rows, kv_step_rows

NAME = "usermark"
KIND = KIND_USER
SOURCE = "usermark.bpf.c"
STRUCT = "kv_user_small"
TABLE = "user_records"  # decoded further: one table per record type, named after it
VARIABLE_SIZE = True
DTYPE = struct_dtype([("len", "<u4"), ("pad", "<u4"), ("data", "V256")])
HDR = struct.Struct("<BBHIQII")
assert HDR.size == 24 and len(HEADER) == 7


def config(tp) -> tuple[list[str], str | None]:
    if not tp("syscalls", "sys_enter_write"):
        return [], "syscalls:sys_enter_write missing: the vLLM hook's records cannot be received"
    return [], None


def frames(raw: list[bytes], ctx: DecodeContext | None = None) -> list[tuple[int, int, int, bytes]]:
    """(ts, pid, tid, frame bytes) of each marker event.  An item may hold a run of events back
    to back (the ring reader cuts runs of same-sized events of one kind in one piece): each
    event's header says its size.  A piece too short for its header, or whose size does not
    fit, is counted on ``ctx`` as malformed."""
    out = []
    for r in raw:
        pos, end = 0, len(r)
        while pos < end:
            if end - pos < 32:
                _malformed(ctx)
                break
            _kind, _ver, size, _cpu, ts, tgid, tid = HDR.unpack_from(r, pos)
            (n,) = struct.unpack_from("<I", r, pos + 24)
            if size < 32 or pos + size > end or n > size - 32:
                _malformed(ctx)
                break
            out.append((ts, tgid, tid, r[pos + 32:pos + 32 + n]))
            pos += size
    return out


def _malformed(ctx: DecodeContext | None) -> None:
    if ctx is not None:
        ctx.malformed += 1


def records(raw: list[bytes], ctx: DecodeContext | None = None) -> dict[str, list[dict]]:
    """Every record of every frame, by record name, with the marker's ts/pid/tid added (the tid
    a `thread` record names, for the records after it).  A frame the probe could not copy
    (empty) or that is not one is counted on ``ctx``."""
    out: dict[str, list[dict]] = {}
    for ts, pid, tid, frame in frames(raw, ctx):
        if ctx is not None and not frame.startswith(MAGIC):
            ctx.bad_frames += 1
            continue
        for name, rec in CODEC.decode_frame(frame):
            if name == "thread":    # made on another thread than the one that wrote the frame
                tid = rec["tid"]
                continue
            if name == "evicts":   # a batch: one evict row per hash
                rows = out.setdefault("evict", [])
                for row in evict_rows(rec):
                    row.update(mark_ns=ts, pid=pid, tid=tid)
                    rows.append(row)
                continue
            if name in ("kv_step", "kv_step2"):  # a Worker step: its kv_load and kv_store rows
                for rname, row in kv_step_rows(rec):
                    row.update(mark_ns=ts, pid=pid, tid=tid)
                    out.setdefault(rname, []).append(row)
                continue
            rec.update(mark_ns=ts, pid=pid, tid=tid)
            out.setdefault(name, []).append(rec)
    return out


# Column types from the wire codes: inference would make u64 values >= 2**63 (block hashes) overflow.
ARROW_TYPES = {"B": pa.uint8(), "H": pa.uint16(), "I": pa.uint32(), "Q": pa.uint64(), "b": pa.int8(),
               "h": pa.int16(), "i": pa.int32(), "q": pa.int64(), "d": pa.float64(), "s": pa.string(),
               "U": pa.list_(pa.uint64())}


def schema_for(name: str) -> pa.Schema | None:
    spec = CODEC.by_name.get(name)
    if spec is None or any(code not in ARROW_TYPES for _, code in spec[1]):
        return None
    fields = [(f, ARROW_TYPES[code]) for f, code in spec[1]]
    return pa.schema(fields + [("mark_ns", pa.uint64()), ("pid", pa.uint32()), ("tid", pa.uint32())])


def decode(raw: list[bytes], ctx: DecodeContext) -> dict[str, pa.Table]:
    return {name: pa.Table.from_pylist(rows, schema=schema_for(name)) for name, rows in records(raw, ctx).items()}
