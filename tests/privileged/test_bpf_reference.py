"""The real tcp probe against tests/bpf_reference.py's TcpReference, on records this kernel wrote.

A BPF program of the test's own copies every record of the tcp probe's tracepoints on two
loopback ports, one in the NVMe/TCP port set (--nvme-tcp-port) and one not; those records,
decoded by their format and fed to TcpReference, must give exactly the rows kvtrace's probe
wrote (the port filter, the fields, the SYN-ACK retransmit, the tcp_probe rate limit and the
count of probes each sample stands for).

nvme.bpf.c and rdma.bpf.c against NvmeReference and RdmaReference: their tracepoints do not
fire here (no NVMe, no RDMA); only the lab guest (tests/lab) has them, and its tests compare
the probes with ftrace's counts, not with the References.
"""
from __future__ import annotations

import ctypes
import json
import socket
import struct
import sys
from collections import Counter

import pytest

from kvtrace.capture import tcp, tpformat
from kvtrace.capture.events import DecodeContext
from kvtrace.dataset.reader import Dataset
from tests.bpf_reference import TcpReference
from tests.conftest import run_kvtrace

pytestmark = pytest.mark.root

EVENTS = [("tcp", "tcp_retransmit_skb"), ("tcp", "tcp_retransmit_synack"), ("sock", "inet_sock_set_state"),
          ("tcp", "tcp_probe")]

RECORDER = r"""
struct rec { u64 ts; u32 pid; u32 tid; u32 ev; u32 len; u8 data[256]; };
BPF_RINGBUF_OUTPUT(out, 256);
BPF_ARRAY(lost, u64, 1);

#define KEEP(s, d) ((s) == P1 || (d) == P1 || (s) == P2 || (d) == P2)
static __always_inline int record(const void *args, u32 len, u32 ev)
{
    struct rec *r = out.ringbuf_reserve(sizeof(struct rec));
    if (!r) {
        int z = 0;
        u64 *n = lost.lookup(&z);
        if (n)
            __sync_fetch_and_add(n, 1);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    r->ts = bpf_ktime_get_ns();
    r->pid = id >> 32;
    r->tid = (u32)id;
    r->ev = ev;
    if (len > sizeof(r->data))
        len = sizeof(r->data);
    r->len = len;
    bpf_probe_read_kernel(r->data, len, args);
    out.ringbuf_submit(r, 0);
    return 0;
}
#define RECORD(EV) return record(args, sizeof(*args), EV);

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)    { if (!KEEP(args->sport, args->dport)) return 0; RECORD(0) }
TRACEPOINT_PROBE(tcp, tcp_retransmit_synack) { if (!KEEP(args->sport, args->dport)) return 0; RECORD(1) }
TRACEPOINT_PROBE(sock, inet_sock_set_state)  { if (!KEEP(args->sport, args->dport)) return 0; RECORD(2) }
TRACEPOINT_PROBE(tcp, tcp_probe)             { if (!KEEP(args->sport, args->dport)) return 0; RECORD(3) }
"""

# Two listeners: PORT (watched, TCP_DEFER_ACCEPT: its SYN-ACK goes again after 1 s) and OTHER
# (not watched).  Bursts of ping-pongs 60 ms apart: within a burst one tcp_probe sample per
# connection standing for the rest, across bursts a new one.  Quiet for 0.3 s at either end.
WORKLOAD = r"""
import json, socket, sys, time
port, other, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t0 = time.monotonic_ns()
time.sleep(0.3)
lst = {}
for p in (port, other):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if p == port:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
    s.bind(("127.0.0.1", p)); s.listen(1); lst[p] = s
cli = {p: socket.create_connection(("127.0.0.1", p)) for p in (port, other)}
time.sleep(2.5)                  # no data: the deferring listener sends its SYN-ACK again
for c in cli.values():
    c.sendall(b"hello")
srv = {p: lst[p].accept()[0] for p in (port, other)}
for p in (port, other):
    assert srv[p].recv(5) == b"hello"
for burst in range(5):
    time.sleep(0.06)
    for _ in range(4):
        for p in (port, other):
            cli[p].sendall(b"x" * 100); srv[p].recv(100)
            srv[p].sendall(b"y" * 100); cli[p].recv(100)
for p in (port, other):
    cli[p].close(); srv[p].close(); lst[p].close()
time.sleep(0.3)
json.dump({"t0": t0, "t1": time.monotonic_ns()}, open(out, "w"))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key(row: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in row.items() if k != "ts_ns"))


def test_tcp_probe_rows_equal_the_reference_on_this_kernels_records(tmp_path):
    from bcc import BPF

    port, other = free_port(), free_port()
    assert port != other
    fmts = {ev: tpformat.read(*ev) for ev in EVENTS}
    assert all(fmts.values()), fmts
    b = BPF(text=RECORDER.replace("P1", str(port)).replace("P2", str(other)).encode())
    recs = []

    def got(ctx, data, size):
        raw = bytes((ctypes.c_ubyte * size).from_address(data))
        ts, pid, tid, ev, n = struct.unpack_from("<QIIII", raw)
        recs.append((ts, pid, tid, ev, raw[24:24 + n]))

    b[b"out"].open_ring_buffer(got)
    try:
        out, res = tmp_path / "ds", tmp_path / "res.json"
        p = run_kvtrace("attach", "--quiet", "--probe", "tcp", "--nvme-tcp-port", str(port), "--out", str(out),
                        "--", sys.executable, "-c", WORKLOAD, str(port), str(other), str(res), timeout=300)
        assert p.returncode == 0, p.stderr
        b.ring_buffer_consume()
        assert b[b"lost"][ctypes.c_int(0)].value == 0
    finally:
        b.cleanup()
    truth = json.loads(res.read_text())
    in_window = lambda ts: truth["t0"] <= ts <= truth["t1"]

    # the kernel's records, as the reference rules see them
    ref = TcpReference(ports=(port,), probe_interval_ns=10_000_000)
    fed = Counter()
    for ts, pid, tid, ev, data in sorted(r for r in recs if in_window(r[0])):
        system, event = EVENTS[ev]
        f = fmts[(system, event)]
        fields = f.decode(data.ljust(f.size, b"\0"))
        ref.feed(event, fields, ts, pid, tid)
        fed[(event, port in (fields["sport"], fields["dport"]))] += 1
    expected = tcp.decode(ref.events, DecodeContext()).to_pylist()

    ds = Dataset.open(out)
    (run,) = ds.runs()
    assert run["lost_events"] == {} and run["dropped_events"] == 0 and run["kernel_skips"] == {}, run
    real = [r for r in ds.table("tcp_events").to_pylist()
            if in_window(r["ts_ns"]) and {r["sport"], r["dport"]} & {port, other}]
    cols = set(expected[0]) if expected else set()
    real = [{k: v for k, v in r.items() if k in cols} for r in real]

    # the run had what it is meant to exercise: both ports, every kind of event the kernel made
    assert fed[("tcp_probe", False)] > 0 and fed[("inet_sock_set_state", False)] > 0, fed   # the filter's work
    assert fed[("tcp_probe", True)] > len([r for r in expected if r["event"] == "probe"]) > 0, fed  # rate limit
    assert {r["event"] for r in expected} >= {"state", "probe", "synack_retransmit"}, fed
    assert all(port in (r["sport"], r["dport"]) for r in expected)
    assert any(r["probes"] > 1 for r in expected if r["event"] == "probe")
    # and the probe wrote exactly the rows the reference rules predict
    assert Counter(map(key, real)) == Counter(map(key, expected))
    assert len(real) == len(expected)
