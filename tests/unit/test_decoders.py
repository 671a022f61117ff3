"""Decoders on recorded ring-buffer bytes (tests/data/events-6.18.raw, made by
record_fixture.py on kernel 6.18): the decoded rows agree with the workload's own account
(tests/data/events-6.18.json).  No root, no bcc."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kvtrace.capture import blockio, events, fileio, iouring, rawfile, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.attach.pipeline import Pipeline

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def recorded():
    return rawfile.read(DATA / "events-6.18.raw"), json.loads((DATA / "events-6.18.json").read_text())


def test_uring_rows_pair_submit_and_complete(recorded):
    batch, truth = recorded
    t = iouring.decode(batch[events.KIND_URING], DecodeContext()).to_pylist()
    pid = truth["uring"]["pid"]
    mine = [r for r in t if r["pid"] == pid and r["op"] == "READ"]
    assert [(r["user_data"], r["res"]) for r in mine] == [tuple(c) for c in truth["uring"]["completions"]]
    assert sum(r["bytes"] for r in mine) == truth["uring"]["bytes"]
    assert all(r["tid"] == truth["uring"]["tid"] and r["latency_ns"] > 0 for r in mine)


def test_block_rows_match_the_direct_and_uring_reads(recorded):
    batch, truth = recorded
    ctx = DecodeContext(dev_names={7 << 20: "loop0"})
    t = blockio.decode(batch[events.KIND_BLOCK], ctx).to_pylist()
    loop = [r for r in t if (r["dev_major"], r["dev_minor"]) == (7, 0)]
    # 4 O_DIRECT preadv + 4 io_uring reads of 64 KiB, one request each, all reads
    assert len(loop) == truth["direct"]["calls"] + truth["uring"]["calls"]
    assert sum(r["bytes"] for r in loop) == truth["direct"]["bytes"] + truth["uring"]["bytes"]
    assert {r["op"] for r in loop} == {"R"}
    assert sorted(r["sector"] for r in loop) == sorted([i * 128 for i in range(4)] * 2)
    assert all(r["pid"] == truth["direct"]["pid"] and r["latency_ns"] > 0 and r["queue_ns"] >= 0 for r in loop)
    assert all(r["latency_ns"] == r["queue_ns"] + r["device_ns"] for r in loop)


def test_fileio_rows_resolve_paths_from_recorded_opens(recorded):
    batch, truth = recorded
    p = Pipeline.__new__(Pipeline)
    p.ctx = DecodeContext()
    tables = Pipeline.decode(p, batch)
    io = tables["file_io"].to_pylist()
    direct = [r for r in io if r["path"] == "/dev/loop0" and r["syscall"] == "preadv2"]
    assert len(direct) == truth["direct"]["calls"]  # glibc preadv() is the preadv2 syscall
    assert [r["offset"] for r in direct] == [i * 65536 for i in range(4)]
    assert sum(r["bytes"] for r in direct) == truth["direct"]["bytes"]
    assert all(r["iovcnt"] == 1 and r["requested"] == 0 for r in direct)
    opens = [r for r in tables["file_open"].to_pylist() if r["path"] == "/dev/loop0"]
    assert len(opens) == 2  # read_direct and read_uring each open the device once


def test_user_marker_frame_decodes(recorded):
    batch, truth = recorded
    recs = usermark.records(batch[events.KIND_USER])
    (start,) = recs["hook_start"]
    assert start["role"] == "fixture" and start["pid"] == truth["direct"]["pid"]
    assert start["mark_ns"] >= start["t_ns"]  # the marker is caught after the record was stamped


def test_records_of_the_wrong_size_are_not_decoded():
    good = np.zeros(1, dtype=fileio.DTYPE)
    good["kind"], good["size"], good["ret"] = events.KIND_FILEIO, fileio.DTYPE.itemsize, 7
    raw = [good.tobytes(), good.tobytes()[:-8], b"\x02" * 3]
    t = fileio.decode(raw, DecodeContext())
    assert t.num_rows == 1 and t["ret"].to_pylist() == [7]


def test_negative_results_are_errors_not_bytes():
    rec = np.zeros(2, dtype=fileio.DTYPE)
    rec["kind"], rec["sys"], rec["ret"], rec["ts"], rec["ts_enter"] = events.KIND_FILEIO, 1, [-11, 4096], [20, 30], [10, 10]
    t = fileio.decode([r.tobytes() for r in rec], DecodeContext()).to_pylist()
    assert [(r["bytes"], r["ret"], r["syscall"], r["latency_ns"]) for r in t] == [(0, -11, "pread64", 10), (4096, 4096, "pread64", 20)]


def test_a_block_request_whose_completion_went_unseen_has_no_latency():
    rec = np.zeros(2, dtype=blockio.DTYPE)
    rec["kind"], rec["size"], rec["weight"], rec["bytes"] = events.KIND_BLOCK, blockio.DTYPE.itemsize, 1, 4096
    rec["ts_start"], rec["ts_issue"], rec["ts"], rec["sector"] = [100, 500], [110, 510], [400, 900], [8, 8]
    rec["error"] = [blockio.UNSEEN, 0]
    rec["rwbs"] = b"RS"
    t = blockio.decode([r.tobytes() for r in rec], DecodeContext()).to_pylist()
    assert [(r["error"], r["queue_ns"], r["device_ns"], r["latency_ns"], r["bytes"]) for r in t] == [
        (None, 10, None, None, 4096), (0, 10, 390, 400, 4096)]


def test_rawfile_ignores_a_truncated_tail(tmp_path):
    p = tmp_path / "r.raw"
    p.write_bytes(struct.pack("<I", 3) + b"\x01ab" + struct.pack("<I", 10) + b"\x02abc")
    assert rawfile.read(p) == {1: [b"\x01ab"]}
