"""Bad input, fuzzed: decoders of recorded events, the hook's wire frames, raw files and
Parquet files never crash or hang; they decode what is whole and skip or report the rest."""
from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.capture import BY_KIND, PROBES, events, rawfile, usermark
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


def decoding_pipeline():
    p = Pipeline.__new__(Pipeline)
    p.ctx = DecodeContext()
    return p


@FAST
@given(st.dictionaries(st.integers(0, 15), st.lists(st.binary(max_size=300), max_size=8), max_size=6))
def test_pipeline_decodes_any_batch(batch):
    p = decoding_pipeline()
    p.decode(batch)
    assert p.ctx.malformed <= sum(len(raw) for raw in batch.values())  # at most one per item


def marker(payload: bytes, size: int | None = None, n: int | None = None) -> bytes:
    """A usermark event: its 32-byte header (size, then the payload length n) and payload."""
    size = 32 + len(payload) if size is None else size
    return usermark.HDR.pack(events.KIND_USER, 1, size, 0, 1, 100, 100) + struct.pack(
        "<I", len(payload) if n is None else n) + bytes(4) + payload


def test_pipeline_counts_exactly_the_malformed_records():
    fixed = [pr for pr in PROBES if not getattr(pr, "VARIABLE_SIZE", False)]
    unknown = sorted(set(range(16)) - set(BY_KIND))
    assert len(fixed) == 10 and unknown == [0, 12, 13, 14, 15]
    batch = {}
    for pr in fixed:  # whole: one record, a run of two; malformed: empty, short, long, a run cut short
        n = pr.DTYPE.itemsize
        batch[pr.KIND] = [bytes(n), bytes(2 * n), b"", bytes(n - 1), bytes(n + 1), bytes(2 * n - 3)]
    for kind in unknown:  # every record of a kind no probe writes
        batch[kind] = [bytes(8), bytes(136)]
    good = marker(MAGIC + CODEC.encode("hook_stats", 7, 1, 2, 3, "x"))
    batch[events.KIND_USER] = [good, good + good,
                               good[:20],                     # shorter than a header
                               marker(b"abc", size=64),       # its size runs past the item
                               marker(b"abc", n=200),         # its payload length does not fit its size
                               good + good[:-1]]              # a run whose second event is cut
    p = decoding_pipeline()
    out = p.decode(batch)
    assert p.ctx.malformed == 4 * len(fixed) + 2 * len(unknown) + 4
    assert out["hook_stats"].num_rows == 4


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
