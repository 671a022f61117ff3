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


class Reference:
    """tcp.bpf.c's filter and probe rate limit in Python, over decoded tracepoint records
    (as nvme.Reference): ``feed(event, fields, ts)`` appends kv_tcp_event records to
    ``events``.  Used by the tests on records of several kernels' layouts."""

    def __init__(self, ports=DEFAULT_PORTS, probe_interval_ns: int = 10_000_000):
        self.ports = set(ports)
        self.every = probe_interval_ns
        self.last: dict[int, list[int]] = {}
        self.events: list[bytes] = []

    def _new(self, typ: int, ts: int, pid: int = 0, tid: int = 0) -> np.ndarray:
        e = np.zeros(1, dtype=DTYPE)
        e["kind"], e["version"], e["size"], e["ts"], e["tgid"], e["tid"], e["type"] = KIND_TCP, 1, DTYPE.itemsize, ts, pid, tid, typ
        return e

    @staticmethod
    def _addrs(e, family, f, v4="saddr", v6="saddr_v6", dv4="daddr", dv6="daddr_v6"):
        if family == 10:
            e["saddr"][0][:16] = list(f[v6])
            e["daddr"][0][:16] = list(f[dv6])
        else:
            e["saddr"][0][:4] = list(f[v4])[:4]
            e["daddr"][0][:4] = list(f[dv4])[:4]

    def feed(self, event: str, f: dict, ts: int, pid: int = 0, tid: int = 0) -> None:
        if f["sport"] not in self.ports and f["dport"] not in self.ports:
            return
        if event in ("tcp_retransmit_skb", "tcp_retransmit_synack"):
            synack = event == "tcp_retransmit_synack"
            e = self._new(4 if synack else 1, ts, pid, tid)
            state = STATES.index("NEW_SYN_RECV") if synack else f["state"]
            e["skaddr"], e["state"], e["sport"], e["dport"] = f["skaddr"], state, f["sport"], f["dport"]
            e["family"] = f.get("family", 2)
            e["err"] = f.get("err", 0)
            self._addrs(e, int(e["family"][0]), f)
        elif event == "inet_sock_set_state":
            if f["protocol"] != 6:
                return
            e = self._new(2, ts, pid, tid)
            e["skaddr"], e["state"], e["newstate"] = f["skaddr"], f["oldstate"], f["newstate"]
            e["sport"], e["dport"], e["family"] = f["sport"], f["dport"], f["family"]
            self._addrs(e, f["family"], f)
        elif event == "tcp_probe":
            key = f.get("skaddr") or f.get("sock_cookie") or (f["sport"] << 16 | f["dport"])
            last = self.last.get(key)
            if last and ts - last[0] < self.every:
                last[1] += 1
                return
            probes = last[1] + 1 if last else 1
            self.last[key] = [ts, 0]
            e = self._new(3, ts, pid, tid)
            e["probes"], e["skaddr"], e["sock_cookie"] = probes, f.get("skaddr", 0), f.get("sock_cookie", 0)
            for k in ("srtt", "snd_cwnd", "ssthresh", "snd_wnd", "rcv_wnd", "data_len"):
                e["srtt_us" if k == "srtt" else k] = f[k]
            e["sport"], e["dport"] = f["sport"], f["dport"]
            sa, da = bytes(f["saddr"]), bytes(f["daddr"])
            family = sa[0] | sa[1] << 8
            e["family"] = family
            off, n = (8, 16) if family == 10 else (4, 4)
            e["saddr"][0][:n] = list(sa[off:off + n])
            e["daddr"][0][:n] = list(da[off:off + n])
        else:
            return
        self.events.append(e.tobytes())


def sockaddr(ip: str, port: int) -> bytes:
    """A sockaddr_in / sockaddr_in6 in a 28-byte field, as tcp_probe stores it."""
    a = ipaddress.ip_address(ip)
    if a.version == 4:
        b = (2).to_bytes(2, "little") + port.to_bytes(2, "big") + a.packed
    else:
        b = (10).to_bytes(2, "little") + port.to_bytes(2, "big") + bytes(4) + a.packed + bytes(4)
    return b.ljust(28, b"\0")
