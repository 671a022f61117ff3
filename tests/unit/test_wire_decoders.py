"""The hook records' compiled decoders (kvtrace.hook.wire.Codec._compile_decoder) against the
field-by-field reference decoder, on every record type: valid records with random values,
the same cut at every length, and garbage."""
from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.hook.wire import CODEC, MAGIC, RECORDS

RANGES = {"B": (0, 2**8 - 1), "H": (0, 2**16 - 1), "I": (0, 2**32 - 1), "Q": (0, 2**64 - 1),
          "b": (-2**7, 2**7 - 1), "h": (-2**15, 2**15 - 1), "i": (-2**31, 2**31 - 1), "q": (-2**63, 2**63 - 1)}


def value(code: str):
    if code == "s":
        return st.text(max_size=40)
    if code == "U":
        return st.lists(st.integers(0, 2**64 - 1), max_size=20)
    if code == "d":
        return st.floats(allow_nan=False)
    return st.integers(*RANGES[code])


record = st.sampled_from(sorted(RECORDS)).flatmap(
    lambda tid: st.tuples(st.just(tid), st.tuples(*[value(c) for _, c in RECORDS[tid][1]])))


@settings(max_examples=400, deadline=None)
@given(record)
def test_compiled_decoder_equals_the_reference_on_every_cut(rec):
    tid, values = rec
    name, fields = RECORDS[tid]
    body = CODEC.encode(name, *values)[4:]
    decode = CODEC.decoders[tid][1]
    full = decode(body)
    assert full == CODEC._decode_body(fields, body)
    assert list(full) == [f for f, _ in fields]
    assert [full[f] for f, c in fields if c not in "s"] == [v for v, (_, c) in zip(values, fields) if c not in "s"]
    for cut in range(len(body)):
        assert decode(body[:cut]) == CODEC._decode_body(fields, body[:cut]), cut


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(RECORDS)), st.binary(max_size=200))
def test_compiled_decoder_equals_the_reference_on_garbage(tid, body):
    assert CODEC.decoders[tid][1](body) == CODEC._decode_body(RECORDS[tid][1], body)


def test_a_frame_of_every_type_decodes_in_order():
    values = {tid: [("x" if c == "s" else [1, 2**64 - 1] if c == "U" else 1.5 if c == "d" else 7) for _, c in fields]
              for tid, (_, fields) in RECORDS.items()}
    frame = MAGIC + b"".join(CODEC.encode(RECORDS[tid][0], *values[tid]) for tid in sorted(RECORDS))
    frame += struct.pack("<HH", 999, 3) + b"abc"          # an unknown type is skipped by its length
    out = CODEC.decode_frame(frame)
    assert [n for n, _ in out] == [RECORDS[tid][0] for tid in sorted(RECORDS)]
    for (name, rec), tid in zip(out, sorted(RECORDS)):
        assert list(rec.values()) == values[tid], name
