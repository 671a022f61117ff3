"""Bad input, fuzzed: decoders of recorded events, the hook's wire frames, raw files and
Parquet files never crash or hang; they decode what is whole and skip or report the rest."""
from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.capture import PROBES, events, rawfile, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.dataset.reader import Dataset
from kvtrace.errors import DatasetError
from kvtrace.hook.wire import CODEC, MAGIC
from kvtrace.attach.pipeline import Pipeline

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(st.lists(st.binary(min_size=0, max_size=400), max_size=20), st.sampled_from(PROBES))
def test_decoders_take_any_bytes(raw, probe):
    out = probe.decode(raw, DecodeContext())
    tables = out.values() if isinstance(out, dict) else [out]
    for t in tables:
        assert t.num_rows <= sum(len(r) for r in raw)


@FAST
@given(st.dictionaries(st.integers(0, 15), st.lists(st.binary(max_size=300), max_size=8), max_size=6))
def test_pipeline_decode_counts_malformed_records(batch):
    p = Pipeline.__new__(Pipeline)
    p.ctx = DecodeContext()
    p.decode(batch)
    assert p.ctx.malformed >= 0


@FAST
@given(st.binary(max_size=2000))
def test_wire_frames_of_garbage(data):
    CODEC.decode_frame(data)
    CODEC.decode_frame(MAGIC + data)


@FAST
@given(st.lists(st.tuples(st.integers(1, 65535), st.binary(max_size=64)), max_size=30))
def test_wire_frames_with_unknown_and_short_records(recs):
    frame = MAGIC + b"".join(struct.pack("<HH", t, len(b)) + b for t, b in recs)
    CODEC.decode_frame(frame)
    frame_cut = frame[: len(frame) // 2]
    CODEC.decode_frame(frame_cut)


def test_wire_round_trip():
    rec = CODEC.encode("hook_stats", 7, 1, 2, 3, "é" * 5)
    (name, fields), = CODEC.decode_frame(MAGIC + rec)
    assert name == "hook_stats" and fields == {"t_ns": 7, "emitted": 1, "dropped": 2, "errors": 3, "last_error": "é" * 5}


@FAST
@given(st.binary(max_size=3000))
def test_usermark_frames_of_garbage(body):
    rec = bytes([events.KIND_USER]) + body
    usermark.records([rec])


@FAST
@given(data=st.binary(max_size=4000))
def test_raw_files_of_garbage(tmp_path, data):
    p = tmp_path / "x.raw"
    p.write_bytes(data)
    rawfile.read(p)


@FAST
@given(data=st.binary(max_size=3000))
def test_corrupt_parquet_is_reported_by_name(tmp_path, data):
    d = tmp_path / "ds"
    (d / "file_io" / "host=h" / "date=d").mkdir(parents=True, exist_ok=True)
    bad = d / "file_io" / "host=h" / "date=d" / "r.parquet"
    bad.write_bytes(b"PAR1" + data)
    try:
        ds = Dataset.open(d)
    except DatasetError:
        return
    t = ds.table("file_io")
    assert t.num_rows == 0 or not ds.problems
    if t.num_rows == 0:
        assert any("r.parquet" in p for p in ds.problems)
