"""Decoder for probes/tcp.bpf.c: retransmits (of segments and of SYN-ACKs), state changes and
RTT/cwnd samples of TCP connections on the NVMe/TCP ports (table ``tcp_events``)."""
from __future__ import annotations

import ipaddress

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_TCP, DecodeContext, decode_array, struct_dtype
from kvtrace.capture import tpformat

NAME = "tcp"
KIND = KIND_TCP
SOURCE = "tcp.bpf.c"
STRUCT = "kv_tcp_event"
TABLE = "tcp_events"
DTYPE = struct_dtype(
    [
        ("skaddr", "<u8"),
        ("sock_cookie", "<u8"),
        ("srtt_us", "<u4"),
        ("snd_cwnd", "<u4"),
        ("ssthresh", "<u4"),
        ("snd_wnd", "<u4"),
        ("rcv_wnd", "<u4"),
        ("data_len", "<u4"),
        ("probes", "<u4"),
        ("err", "<i4"),
        ("sport", "<u2"),
        ("dport", "<u2"),
        ("family", "<u2"),
        ("type", "u1"),
        ("state", "u1"),
        ("newstate", "u1"),
        ("pad", "u1", (7,)),
        ("saddr", "u1", (16,)),
        ("daddr", "u1", (16,)),
    ]
)
DEFAULT_PORTS = (4420,)
EVENTS = {1: "retransmit", 2: "state", 3: "probe", 4: "synack_retransmit"}
# include/net/tcp_states.h
STATES = ["", "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2", "TIME_WAIT", "CLOSE",
          "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING", "NEW_SYN_RECV", "BOUND_INACTIVE"]
FAMILIES = {2: "ipv4", 10: "ipv6"}


def _default_fields(system: str, event: str):

    return tpformat.field_names(system, event)


def config(tp, fields=None) -> tuple[list[str], str | None]:
    fields = fields or _default_fields
    flags = []
    if tp("tcp", "tcp_retransmit_skb"):
        f = fields("tcp", "tcp_retransmit_skb")
        if f is None or {"skaddr", "state", "sport", "dport", "saddr", "daddr", "saddr_v6", "daddr_v6"} <= f:
            flags.append("-DKV_TCP_HAVE_RETRANS")
            if f is None or "family" in f:
                flags.append("-DKV_TCP_RETRANS_FAMILY")
            if f is not None and "err" in f:
                flags.append("-DKV_TCP_RETRANS_ERR")
    if tp("tcp", "tcp_retransmit_synack"):
        f = fields("tcp", "tcp_retransmit_synack")
        if f is None or {"skaddr", "sport", "dport", "saddr", "daddr", "saddr_v6", "daddr_v6"} <= f:
            flags.append("-DKV_TCP_HAVE_SYNACK")
            if f is None or "family" in f:
                flags.append("-DKV_TCP_SYNACK_FAMILY")
    if tp("sock", "inet_sock_set_state"):
        f = fields("sock", "inet_sock_set_state")
        if f is None or {"skaddr", "oldstate", "newstate", "sport", "dport", "family", "protocol"} <= f:
            flags.append("-DKV_TCP_HAVE_STATE")
    if tp("tcp", "tcp_probe"):
        f = fields("tcp", "tcp_probe")
        if f is None or {"saddr", "daddr", "sport", "dport", "srtt", "snd_cwnd", "ssthresh", "snd_wnd", "rcv_wnd", "data_len"} <= f:
            flags.append("-DKV_TCP_HAVE_PROBE")
            if f is None or "skaddr" in f:
                flags.append("-DKV_TCP_PROBE_SKADDR")
            if f is None or "sock_cookie" in f:
                flags.append("-DKV_TCP_PROBE_COOKIE")
    if not flags:
        return [], "tcp:tcp_retransmit_skb, tcp:tcp_retransmit_synack, tcp:tcp_probe and sock:inet_sock_set_state missing"
    return flags, None


def addr(family: int, raw: np.ndarray) -> str:
    b = bytes(raw.tolist())
    try:
        if family == 10:
            a = ipaddress.IPv6Address(b)
            return str(a.ipv4_mapped or a)
        return str(ipaddress.IPv4Address(b[:4]))
    except ValueError:
        return ""


def state_name(s: int) -> str:
    return STATES[s] if 0 <= s < len(STATES) else str(s)


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    if len(a) and ctx.tcp_seen is not None:
        ctx.tcp_seen()
    fam = a["family"].tolist()
    sa = [addr(f, x) for f, x in zip(fam, a["saddr"])]
    da = [addr(f, x) for f, x in zip(fam, a["daddr"])]
    sp, dp = a["sport"].tolist(), a["dport"].tolist()
    types = a["type"].tolist()
    is_state = np.array([t == 2 for t in types], dtype=bool)
    is_probe = np.array([t == 3 for t in types], dtype=bool)
    return pa.table({
        "ts_ns": pa.array(a["ts"], pa.uint64()),
        "event": pa.array([EVENTS.get(t, str(t)) for t in types], pa.string()),
        "conn": pa.array([f"{s}:{p}->{d}:{q}" for s, p, d, q in zip(sa, sp, da, dp)], pa.string()),
        "saddr": pa.array(sa, pa.string()),
        "sport": pa.array(a["sport"], pa.uint32()),
        "daddr": pa.array(da, pa.string()),
        "dport": pa.array(a["dport"], pa.uint32()),
        "family": pa.array([FAMILIES.get(f, str(f)) for f in fam], pa.string()),
        "state": pa.array([state_name(s) if t != 3 else "" for s, t in zip(a["state"].tolist(), types)], pa.string()),
        "newstate": pa.array([state_name(s) if t == 2 else "" for s, t in zip(a["newstate"].tolist(), types)], pa.string()),
        "srtt_us": pa.array(a["srtt_us"], pa.uint32(), mask=~is_probe),
        "snd_cwnd": pa.array(a["snd_cwnd"], pa.uint32(), mask=~is_probe),
        "ssthresh": pa.array(a["ssthresh"], pa.uint32(), mask=~is_probe),
        "snd_wnd": pa.array(a["snd_wnd"], pa.uint32(), mask=~is_probe),
        "rcv_wnd": pa.array(a["rcv_wnd"], pa.uint32(), mask=~is_probe),
        "data_len": pa.array(a["data_len"], pa.uint32(), mask=~is_probe),
        "probes": pa.array(a["probes"], pa.uint32(), mask=~is_probe),
        "err": pa.array(a["err"], pa.int32(), mask=np.array([t != 1 for t in types], dtype=bool)),
        "skaddr": pa.array(a["skaddr"], pa.uint64()),
        "sock_cookie": pa.array(a["sock_cookie"], pa.uint64(), mask=~is_probe),
        "pid": pa.array(a["tgid"], pa.uint32()),
        "tid": pa.array(a["tid"], pa.uint32()),
    })



def sockaddr(ip: str, port: int) -> bytes:
    """A sockaddr_in / sockaddr_in6 in a 28-byte field, as tcp_probe stores it."""
    a = ipaddress.ip_address(ip)
    if a.version == 4:
        b = (2).to_bytes(2, "little") + port.to_bytes(2, "big") + a.packed
    else:
        b = (10).to_bytes(2, "little") + port.to_bytes(2, "big") + bytes(4) + a.packed + bytes(4)
    return b.ljust(28, b"\0")
