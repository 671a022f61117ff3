"""`kvtrace attach --otlp` end to end with real BPF capture (root): a process that sends the
hook's records through the real transport (as vLLM's hook would) while it reads a file; the
agent streams spans to a real OTLP receiver, or to an endpoint that is down.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_kvtrace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from otlp_receiver import Receiver, free_port  # noqa: E402

pytestmark = pytest.mark.root
N = 12

# Twelve one-chunk requests, one per engine step; a 64 KiB pread of a file inside every step.
WORKLOAD = r'''
import os, sys, time
from kvtrace.hook.transport import Transport
t = Transport()
deadline = time.monotonic() + 20
while not t.refresh():
    if time.monotonic() > deadline:
        sys.exit("no agent")
    time.sleep(0.05)
fd = os.open(sys.argv[1], os.O_RDONLY)
for i in range(int(sys.argv[2])):
    rid = f"cmpl-req{i}-0-{i:08x}"
    tp = f"00-{i + 1:032x}-{i + 1:016x}-01"
    t0 = time.monotonic_ns()
    t.emit("arrive", i + 1, t0 - 1000, rid, tp, "")
    t.emit("admit", i + 1, rid, 0, 100, 100, 32, 0, 32, 1, 7, 0)
    t.emit("chunk", i + 1, rid, 0, 0, 32, 68, 100, 100, 1, 0)
    t1 = time.monotonic_ns()
    os.pread(fd, 65536, 0)
    time.sleep(0.002)
    t.emit("step", i + 1, t0, t1, time.monotonic_ns(), 1, 68, 1, 68, 0, 0, 1, 0, 0, 0, 0, 1, 0, 100, 0)
    if i:
        t.emit("finish", i + 1, t0, f"cmpl-req{i - 1}-0-{i - 1:08x}")
    t.flush()
    time.sleep(0.01)
t.emit("finish", int(sys.argv[2]) + 1, time.monotonic_ns(), f"cmpl-req{int(sys.argv[2]) - 1}-0-{int(sys.argv[2]) - 1:08x}")
t.flush()
time.sleep(0.2)
'''


def attach(tmp_path, url, *extra):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 1024)
    out = tmp_path / "ds"
    p = run_kvtrace("attach", "--quiet", "--out", str(out), "--otlp", url, *extra, "--",
                    sys.executable, "-c", WORKLOAD, str(data), str(N), timeout=300)
    return p, out


def test_attach_streams_one_trace_per_request(tmp_path):
    with Receiver() as rx:
        p, out = attach(tmp_path, rx.grpc_url)
        assert p.returncode == 0, p.stderr
        spans = list(rx.got.spans)
    chunks = {c["span_id"]: c for c in pq.read_table(out / "chunks").to_pylist()}
    reqs = pq.read_table(out / "requests").to_pylist()
    assert len(reqs) == N and len(chunks) == N and all(r["finished"] and r["joined_trace"] for r in reqs), p.stderr[-2000:]
    by = {}
    for s in spans:
        by.setdefault(s.name, []).append(s)
    assert len(by.get("kvtrace.request", [])) == len(by.get("kvtrace.prefill_chunk", [])) == N, (by.keys(), p.stderr[-2000:])
    for s in by["kvtrace.prefill_chunk"]:
        c = chunks[s.span_id]
        i = int(c["request"].split("-")[1][3:])
        assert s.trace_id == f"{i + 1:032x}"  # the traceparent's trace id
        assert (s.attrs["kvtrace.chunk.cached_tokens"], s.attrs["kvtrace.chunk.token_start"]) == (32, 32)
        # the 64 KiB pread fell inside the step, on another thread than any transfer: shared
        assert c["shared_file_bytes"] == 65536 and s.attrs["kvtrace.chunk.shared_file_bytes"] == 65536
    (sink,) = json.loads(pq.read_table(out / "runs").to_pylist()[-1]["sinks"])
    assert sink["sent"] == len(spans) == 2 * N and sink["dropped"] == 0
    assert f"otlp grpc {rx.grpc_url}: {2 * N} spans sent" in p.stderr


def test_endpoint_down_capture_goes_on(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    p, out = attach(tmp_path, url, "--otlp-protocol", "http")
    assert p.returncode == 0, p.stderr
    assert pq.read_table(out / "step").num_rows == N and pq.read_table(out / "chunks").num_rows == N, p.stderr[-2000:]
    reads = [r for r in pq.read_table(out / "file_io").to_pylist() if r["path"].endswith("data.bin")]
    assert len(reads) == N and {r["bytes"] for r in reads} == {65536}
    (sink,) = json.loads(pq.read_table(out / "runs").to_pylist()[-1]["sinks"])
    assert sink["sent"] == 0 and sink["dropped"] == sink["spans_built"] == 2 * N and sink["last_error"]
    assert f"{2 * N} dropped" in p.stderr
