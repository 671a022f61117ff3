"""The records the hook sends to the agent, and their byte encoding (shared by both sides).

A frame is ``b"KVT1"`` followed by records; a record is ``u16 type, u16 body length, body``.
Bodies are little-endian fields in the order of RECORDS[type]; ``s`` is a string (u16
length + UTF-8), every other code is a struct code.  Times are CLOCK_MONOTONIC ns
(``time.monotonic_ns()``), the clock of bpf_ktime_get_ns().
Prompt token ids are never encoded: prompts appear only as block hashes.
"""
from __future__ import annotations

import struct

MAGIC = b"KVT1"
MAX_FRAME = 4000  # bytes per marker write, magic included (the BPF side copies at most 4080)

# type id -> (record name, [(field, code)]).  Append new types; never renumber.
RECORDS: dict[int, tuple[str, list[tuple[str, str]]]] = {
    1: ("hook_start", [("t_ns", "Q"), ("role", "s"), ("vllm_version", "s"), ("hook_version", "s")]),
    2: ("hook_stats", [("t_ns", "Q"), ("emitted", "Q"), ("dropped", "Q"), ("errors", "Q"), ("last_error", "s")]),
}


class Codec:
    """Precompiled encoders/decoders for RECORDS (strings split the struct into runs)."""

    def __init__(self, records=RECORDS):
        self.records = records
        self.by_name = {name: (tid, fields) for tid, (name, fields) in records.items()}

    def encode(self, name: str, *values) -> bytes:
        tid, fields = self.by_name[name]
        out = bytearray()
        for (field, code), v in zip(fields, values):
            if code == "s":
                b = str(v).encode("utf-8", "replace")[:1024]
                out += struct.pack("<H", len(b)) + b
            else:
                out += struct.pack("<" + code, v)
        return struct.pack("<HH", tid, len(out)) + bytes(out)

    def decode_frame(self, frame: bytes) -> list[tuple[str, dict]]:
        """Records of one frame; an unknown type is skipped by its length, a short one ends the frame."""
        if not frame.startswith(MAGIC):
            return []
        out, pos, end = [], len(MAGIC), len(frame)
        while pos + 4 <= end:
            tid, n = struct.unpack_from("<HH", frame, pos)
            pos += 4
            body = frame[pos:pos + n]
            pos += n
            if len(body) < n:
                break
            spec = self.records.get(tid)
            if spec is None:
                continue
            rec = self._decode_body(spec[1], body)
            if rec is not None:
                out.append((spec[0], rec))
        return out

    @staticmethod
    def _decode_body(fields, body: bytes) -> dict | None:
        rec, pos = {}, 0
        try:
            for field, code in fields:
                if code == "s":
                    (n,) = struct.unpack_from("<H", body, pos)
                    rec[field] = body[pos + 2:pos + 2 + n].decode("utf-8", "replace")
                    pos += 2 + n
                else:
                    (rec[field],) = struct.unpack_from("<" + code, body, pos)
                    pos += struct.calcsize("<" + code)
        except struct.error:
            return None
        return rec


CODEC = Codec()
