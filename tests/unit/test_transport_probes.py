"""tcp and rdma probes: records laid out by the 5.15, 6.1 and 6.18 (6.8+) format files,
filtered and rate-limited by the probes' rules (tests/bpf_reference.py), decoded into rows; their
config follows each layout.  No root."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvtrace.capture import rdma, tcp
from kvtrace.capture.events import DecodeContext
from kvtrace.capture import tpformat
from tests.bpf_reference import RdmaReference, TcpReference

FORMATS = Path(__file__).resolve().parents[1] / "data" / "tpformats"
KERNELS = ["5.15", "6.1", "6.18"]
V4 = lambda s: bytes(int(x) for x in s.split("."))


def fmt(kernel, system, event):
    return tpformat.read(system, event, FORMATS / kernel)


def tp_for(kernel):
    return lambda c, e: (FORMATS / kernel / "events" / c / e).is_dir()


def fields_for(kernel):
    return lambda c, e: tpformat.field_names(c, e, FORMATS / kernel)


def feed(ref, kernel, system, tp, ts, **values):
    f = fmt(kernel, system, tp)
    ref.feed(tp, f.decode(f.encode(values)), ts)


@pytest.mark.parametrize("kernel", KERNELS)
def test_tcp_state_rtt_and_retransmits_on_the_nvme_port(kernel):
    ref = TcpReference(ports=(4420,), probe_interval_ns=10_000_000)
    sk = 0xFFFF888012345600
    conn = dict(sport=51234, dport=4420, family=2, saddr=V4("10.10.0.1"), daddr=V4("10.10.0.2"))
    feed(ref, kernel, "sock", "inet_sock_set_state", 1000, skaddr=sk, oldstate=7, newstate=2, protocol=6, **conn)
    feed(ref, kernel, "sock", "inet_sock_set_state", 2000, skaddr=sk, oldstate=2, newstate=1, protocol=6, **conn)
    feed(ref, kernel, "sock", "inet_sock_set_state", 2500, skaddr=sk, oldstate=2, newstate=1, protocol=17, **conn)  # not TCP
    other = dict(conn, dport=22)
    feed(ref, kernel, "sock", "inet_sock_set_state", 2600, skaddr=sk + 1, oldstate=2, newstate=1, protocol=6, **other)
    # probes every 2.5 ms: one event per 10 ms, the second standing for the 3 it skipped and itself
    for i in range(6):
        feed(ref, kernel, "tcp", "tcp_probe", 3_000_000 + i * 2_500_000, saddr=tcp.sockaddr("10.10.0.1", 51234),
             daddr=tcp.sockaddr("10.10.0.2", 4420), sport=51234, dport=4420, family=2, srtt=180 + i, snd_cwnd=10 + i,
             ssthresh=0x7FFFFFFF, snd_wnd=65536, rcv_wnd=131072, data_len=4096, sock_cookie=77, skaddr=sk)
    v6 = dict(sport=4420, dport=40000, family=10, saddr_v6=bytes(15) + b"\x01", daddr_v6=bytes(15) + b"\x02")
    feed(ref, kernel, "tcp", "tcp_retransmit_skb", 20_000_000, skaddr=sk + 2, state=1, **v6)
    # a listener's SYN-ACK again (the handshake's last ACK lost or dropped); other ports not kept
    listener = 0xFFFF888012349900
    syn = dict(sport=4420, dport=51300, family=2, saddr=V4("10.10.0.2"), daddr=V4("10.10.0.9"))
    feed(ref, kernel, "tcp", "tcp_retransmit_synack", 21_000_000, skaddr=listener, req=listener + 64, **syn)
    feed(ref, kernel, "tcp", "tcp_retransmit_synack", 22_000_000, skaddr=listener, req=listener + 128, **dict(syn, sport=22))
    rows = tcp.decode(ref.events, DecodeContext()).to_pylist()
    assert [r["event"] for r in rows] == ["state", "state", "probe", "probe", "retransmit", "synack_retransmit"]
    sa = rows[5]
    assert (sa["conn"], sa["skaddr"], sa["state"], sa["err"], sa["ts_ns"]) == (
        "10.10.0.2:4420->10.10.0.9:51300", listener, "NEW_SYN_RECV", None, 21_000_000)
    assert [(r["state"], r["newstate"]) for r in rows[:2]] == [("CLOSE", "SYN_SENT"), ("SYN_SENT", "ESTABLISHED")]
    assert {r["conn"] for r in rows[:4]} == {"10.10.0.1:51234->10.10.0.2:4420"}
    p1, p2 = rows[2], rows[3]
    assert (p1["probes"], p1["srtt_us"], p1["snd_cwnd"]) == (1, 180, 10)
    assert (p2["probes"], p2["srtt_us"], p2["snd_cwnd"], p2["ts_ns"] - p1["ts_ns"]) == (4, 184, 14, 10_000_000)
    has_skaddr = fmt(kernel, "tcp", "tcp_probe").has("skaddr")
    assert has_skaddr is (kernel == "6.18") and p1["skaddr"] == (sk if has_skaddr else 0) and p1["sock_cookie"] == 77
    assert rows[0]["srtt_us"] is None   # RTT fields belong to probe rows only
    rt = rows[4]
    assert (rt["family"], rt["saddr"], rt["daddr"], rt["state"], rt["sport"]) == ("ipv6", "::1", "::2", "ESTABLISHED", 4420)
    flags, why = tcp.config(tp_for(kernel), fields_for(kernel))
    assert why is None and {"-DKV_TCP_HAVE_RETRANS", "-DKV_TCP_HAVE_STATE", "-DKV_TCP_HAVE_PROBE",
                            "-DKV_TCP_RETRANS_FAMILY", "-DKV_TCP_PROBE_COOKIE", "-DKV_TCP_HAVE_SYNACK",
                            "-DKV_TCP_SYNACK_FAMILY"} <= set(flags)
    assert ("-DKV_TCP_PROBE_SKADDR" in flags) is has_skaddr


def test_tcp_config_without_tracepoints():
    assert tcp.config(lambda c, e: False) == ([], "tcp:tcp_retransmit_skb, tcp:tcp_retransmit_synack, tcp:tcp_probe and sock:inet_sock_set_state missing")
    flags, why = tcp.config(lambda c, e: e == "tcp_probe", lambda c, e: {"saddr", "daddr", "sport", "dport", "srtt",
                                                                           "snd_cwnd", "ssthresh", "snd_wnd", "rcv_wnd", "data_len"})
    assert why is None and flags == ["-DKV_TCP_HAVE_PROBE"]   # 5.10-like: neither skaddr nor sock_cookie


def sin(ip, port):
    return (2).to_bytes(2, "little") + port.to_bytes(2, "big") + V4(ip) + bytes(20)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rdma_connection_events_and_cq_polling(kernel):
    ref = RdmaReference()
    addrs = dict(srcaddr=sin("10.20.0.1", 0), dstaddr=sin("10.20.0.2", 4420))
    fe = lambda tp, ts, **v: feed(ref, kernel, "rdma_core" if tp.startswith("cq_") else "rdma_cma", tp, ts, **v)
    fe("cm_qp_create", 1, cm_id=7, pd_id=3, tos=0, qp_num=0x11, send_wr=128, recv_wr=129, rc=0, qp_type=2, **addrs)
    fe("cm_send_req", 2, cm_id=7, tos=0, qp_num=0x11, **addrs)
    fe("cm_event_handler", 3, cm_id=7, tos=0, event=9, status=0, **addrs)          # ESTABLISHED
    fe("cm_event_handler", 4, cm_id=8, tos=0, event=8, status=-110, **addrs)       # REJECTED (timed out)
    fe("cq_alloc", 5, cq_id=42, nr_cqe=256, comp_vector=1, poll_ctx=1)
    for rc in (3, 16, 0):
        fe("cq_poll", 6, cq_id=42, requested=16, rc=rc)
    fe("cq_schedule", 7, cq_id=42)
    fe("cq_process", 8, cq_id=42, interrupt=1, latency=35)
    fe("cq_process", 9, cq_id=42, interrupt=0, latency=5)
    fe("cm_disconnect", 10, cm_id=7, tos=0, **addrs)
    fe("cq_free", 11, cq_id=42)
    rows = rdma.decode(ref.events, DecodeContext()).to_pylist()
    assert [r["event"] for r in rows] == ["cm_qp_create", "cm_send_req", "cm_event_handler", "cm_event_handler",
                                          "cq_alloc", "cm_disconnect", "cq_free"]
    qp = rows[0]
    assert (qp["id"], qp["qp_num"], qp["send_wr"], qp["recv_wr"], qp["qp_type"]) == (7, 0x11, 128, 129, "RC")
    assert (qp["src"], qp["dst"]) == ("10.20.0.1:0", "10.20.0.2:4420")
    assert (rows[2]["cm_event"], rows[2]["status"]) == ("ESTABLISHED", 0)
    assert (rows[3]["cm_event"], rows[3]["status"]) == ("REJECTED", -110)
    assert (rows[4]["nr_cqe"], rows[4]["comp_vector"], rows[4]["poll_ctx"], rows[4]["send_wr"]) == (256, 1, "SOFTIRQ", None)
    assert ref.cq[42] == {"polls": 3, "completions": 19, "full_polls": 1, "wakeups": 2, "wakeup_lat_us": 40,
                          "wakeup_lat_max_us": 35, "interrupts": 1, "reschedules": 0}
    flags, why = rdma.config(tp_for(kernel))
    assert why is None and "-DKV_RDMA_TP_CM_EVENT_HANDLER" in flags and "-DKV_RDMA_TP_CQ_POLL" in flags
    assert len(flags) == 22


def test_rdma_config_without_tracepoints_and_ipv6_addresses():
    flags, why = rdma.config(lambda c, e: False)
    assert flags == [] and "not in this kernel" in why
    import numpy as np

    a6 = (10).to_bytes(2, "little") + (4420).to_bytes(2, "big") + bytes(4) + bytes(10) + b"\xff\xff" + V4("10.0.0.9") + bytes(4)
    assert rdma.sockaddr_str(np.frombuffer(a6, dtype=np.uint8)) == "[10.0.0.9]:4420"
    assert rdma.sockaddr_str(np.zeros(28, dtype=np.uint8)) == ""
