"""`kvtrace attach --otlp` end to end with real BPF capture (root): a process that sends the
hook's records through the real transport (as vLLM's hook would) while it reads a file; the
agent streams spans to a real OTLP receiver, to an endpoint that is down, or to a receiver that
goes down for a minute and comes back.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from kvtrace.otlp.exporter import Exporter
from tests.conftest import KVTRACE, REPO, run_kvtrace
from tests.helpers import rss_bytes, wait_for
from tests.otlp_receiver import Receiver, free_port

pytestmark = pytest.mark.root
N = 12

# The hook's transport, once the agent is attached (as vLLM's hook), and the file argv[1] open.
CONNECT = r'''
import os, sys, time
from kvtrace.hook.transport import Transport
t = Transport()
deadline = time.monotonic() + 20
while not t.refresh():
    if time.monotonic() > deadline:
        sys.exit("no agent")
    time.sleep(0.05)
fd = os.open(sys.argv[1], os.O_RDONLY)
'''

# Twelve one-chunk requests, one per engine step; a 64 KiB pread of a file inside every step.
WORKLOAD = CONNECT + r'''
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


# ---------------------------------------------------------------------------------------------
# The backend down for a minute, then back.  A steady workload while a real receiver is up, is
# stopped for OUTAGE_S seconds and is started again on the same port.  Asserted: the exporter's
# queue stays within its bound (spans and bytes) and the agent's memory stops growing once the
# queue is full; the drop count it reports is exactly the spans it built minus the spans the
# receiver decoded; export resumes, and every span of the requests made after the recovery
# arrives; the runs table, the stderr line and `kvtrace summary` state the drops.

OUTAGE_S = 60.0   # how long the backend is down: a real minute
RATE = 300        # requests/s, two spans each: the queue (8192 spans) fills early in the outage
RESUME_S = 30.0   # export resumes well within this after the backend is back (both backoffs cap at 5 s)
_defaults = Exporter.__init__.__kwdefaults__
MAX_QUEUE, MAX_QUEUE_BYTES = _defaults["max_queue"], _defaults["max_queue_bytes"]

# One-chunk requests at RATE per second, one per engine step, a 4 KiB pread inside each step.
# The phase (a file the test writes) is part of each request id; "stop" ends the workload.
OUTAGE_WORKLOAD = CONNECT + r'''
phase_file, period = sys.argv[2], 1.0 / float(sys.argv[3])
phase, prev, i = "1", None, 0
due = time.monotonic()
while True:
    if i % 10 == 0:
        with open(phase_file) as f:
            phase = f.read().strip() or phase
        if phase == "stop":
            break
    rid = f"cmpl-p{phase}r{i}-0-{i:08x}"
    t0 = time.monotonic_ns()
    t.emit("arrive", i + 1, t0 - 1000, rid, "", "")
    t.emit("admit", i + 1, rid, 0, 100, 100, 32, 0, 32, 1, 7, 0)
    t.emit("chunk", i + 1, rid, 0, 0, 32, 68, 100, 100, 1, 0)
    t1 = time.monotonic_ns()
    os.pread(fd, 4096, 0)
    t.emit("step", i + 1, t0, t1, time.monotonic_ns(), 1, 68, 1, 68, 0, 0, 1, 0, 0, 0, 0, 1, 0, 100, 0)
    if prev:
        t.emit("finish", i + 1, t0, prev)
    t.flush()
    prev, i = rid, i + 1
    due += period
    time.sleep(max(0.0, due - time.monotonic()))
t.emit("finish", i + 1, time.monotonic_ns(), prev)
t.flush()
time.sleep(0.2)
'''


def phase_of(span) -> str:
    return span.attrs["kvtrace.request.id"].split("-")[1].split("r")[0][1:]


# both: make test-long (a real minute of outage each); tests/unit/test_otlp.py has the same
# outage in process, in every CI run
@pytest.mark.long
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_backend_down_for_a_minute_then_back(tmp_path, protocol):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 16)
    phase = tmp_path / "phase"
    phase.write_text("1")
    out = tmp_path / "ds"
    err = tmp_path / "agent.stderr"
    rx = Receiver().start()
    cmd = [*KVTRACE, "attach", "--quiet", "--out", str(out), "--otlp", rx.url(protocol), "--otlp-protocol", protocol,
           "--", sys.executable, "-c", OUTAGE_WORKLOAD, str(data), str(phase), str(RATE)]
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(err, "wb"), cwd=REPO)
    seen = lambda p: [s for s in list(rx.got.spans) if phase_of(s) == p]  # noqa: E731
    try:
        # up: spans arrive
        wait_for(lambda: agent.poll() is not None or len(seen("1")) >= 2 * RATE, 180, "spans while the backend is up")
        assert agent.poll() is None, err.read_text()[-3000:]
        rss = [rss_bytes(agent.pid)]
        # down for a minute while the workload goes on
        rx.stop()
        phase.write_text("2")
        decoded_before = len(rx.got.spans)
        end = time.monotonic() + OUTAGE_S
        while time.monotonic() < end:
            time.sleep(1.0)
            rss.append(rss_bytes(agent.pid))
        assert agent.poll() is None, err.read_text()[-3000:]
        assert len(rx.got.spans) == decoded_before  # it really was down
        # back on the same port: export resumes; the queue is FIFO, so once a span of a request
        # made after the restart arrives, what was queued during the outage is sent or dropped
        phase.write_text("3")
        rx.start()
        wait_for(lambda: agent.poll() is not None or seen("3"), RESUME_S, "export to resume")
        assert agent.poll() is None, err.read_text()[-3000:]
        phase.write_text("4")
        wait_for(lambda: len(seen("4")) >= 2 * RATE, 60, "spans of the requests made after the recovery")
        phase.write_text("stop")
        rc = agent.wait(180)
        spans = list(rx.got.spans)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        rx.stop(grace=1)
    stderr = err.read_text()
    assert rc == 0, stderr[-3000:]

    (sink,) = json.loads(pq.read_table(out / "runs").to_pylist()[-1]["sinks"])
    requests = pq.read_table(out / "requests").to_pylist()
    chunks = pq.read_table(out / "chunks").to_pylist()
    # nothing was lost between capture and the exporter: every request and chunk row is a span
    # (a ring buffer overflow may cost a hook record; it is counted in lost_events, not here)
    assert sink["input_dropped_rows"] == sink["buffer_dropped_rows"] == sink["correlation_errors"] == 0, sink
    assert sink["spans_built"] == sink["submitted"] == len(requests) + len(chunks), sink

    # bounded: the queue held to its bound, which the outage reached
    assert sink["queue_high_water"] <= MAX_QUEUE and sink["queue_bytes_high_water"] <= MAX_QUEUE_BYTES, sink
    assert sink["dropped_queue_full"] > 0 and sink["failed"] > 0, sink
    # ... and the agent's memory stopped growing: in the outage's second half (the queue full,
    # production going on) its level (the median of a window of samples, so one allocator spike or
    # dip does not decide) grows by less than half of what the spans made between the windows would
    # take if kept
    span_bytes = sink["queue_bytes_high_water"] / sink["queue_high_water"]
    half, w = len(rss) // 2, max(3, len(rss) // 6)
    early, late = statistics.median(rss[half:half + w]), statistics.median(rss[-w:])
    kept = RATE * 2 * (len(rss) - half - w) * span_bytes
    assert late - early < kept / 2, ([x >> 20 for x in rss], kept)
    assert max(rss) - rss[0] <= MAX_QUEUE_BYTES + (64 << 20), [x >> 20 for x in rss]

    # exact: every span built was either decoded once by the receiver or counted dropped
    assert len({s.span_id for s in spans}) == len(spans)
    assert sink["sent"] == len(spans) and sink["dropped"] == sink["spans_built"] - len(spans), (sink, len(spans))
    assert sink["dropped"] == (sink["dropped_queue_full"] + sink["failed"] + sink["rejected"]
                               + sink["dropped_at_shutdown"])

    # resumed: the requests made after the recovery arrived whole, as recorded in Parquet
    after = {r["request"] for r in requests if "-p4r" in r["request"]}
    assert len(after) >= 2 * RATE
    want = {c["span_id"] for c in chunks if c["request"] in after} | {r["span_id"] for r in requests
                                                                     if r["request"] in after}
    got = {s.span_id for s in spans if phase_of(s) == "4"}
    assert got == want and len(want) >= len(after)

    # the recorded stats say so
    assert f"{sink['dropped']} dropped" in stderr
    s = run_kvtrace("summary", str(out))
    assert s.returncode == 0, s.stderr
    assert f"otlp {protocol} {rx.url(protocol)}: {sink['spans_built']} spans built, {sink['sent']} sent, " \
           f"{sink['dropped']} dropped" in s.stdout, s.stdout
