"""Decoder for probes/rdma.bpf.c: RDMA connection-manager events and kernel CQ lifecycle
(table ``rdma_events``); per-CQ polling counters come from a BPF map read by
kvtrace.capture.kstats (table ``rdma_cq``)."""
from __future__ import annotations

import ipaddress

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_RDMA, DecodeContext, cstr, decode_array, struct_dtype

NAME = "rdma"
KIND = KIND_RDMA
SOURCE = "rdma.bpf.c"
STRUCT = "kv_rdma_event"
TABLE = "rdma_events"
DTYPE = struct_dtype(
    [
        ("id", "<u4"),
        ("type", "<u4"),
        ("status", "<i4"),
        ("event", "<u4"),
        ("tos", "<u4"),
        ("qp_num", "<u4"),
        ("a", "<u4"),
        ("b", "<u4"),
        ("c", "<u4"),
        ("d", "<u4"),
        ("srcaddr", "u1", (28,)),
        ("dstaddr", "u1", (28,)),
        ("comm", "S16"),
    ]
)
# KV_RDMA_* (probes/rdma.bpf.c): tracepoint -> type
TYPES = {
    "cm_event_handler": 1, "cm_event_done": 2, "cm_send_req": 3, "cm_send_rep": 4, "cm_send_rtu": 5,
    "cm_send_rej": 6, "cm_disconnect": 7, "cm_sent_dreq": 8, "cm_sent_drep": 9, "cm_id_destroy": 10,
    "cm_qp_create": 11, "cm_qp_destroy": 12, "cm_req_handler": 13, "cm_send_mra": 14,
    "cq_alloc": 20, "cq_alloc_error": 21, "cq_free": 22, "cq_modify": 23,
}
NAMES = {v: k for k, v in TYPES.items()}
CORE_COUNTED = ("cq_poll", "cq_process", "cq_schedule", "cq_reschedule")   # into the rdma_cq map
# enum rdma_cm_event_type (include/rdma/rdma_cm.h)
CM_EVENTS = ["ADDR_RESOLVED", "ADDR_ERROR", "ROUTE_RESOLVED", "ROUTE_ERROR", "CONNECT_REQUEST",
             "CONNECT_RESPONSE", "CONNECT_ERROR", "UNREACHABLE", "REJECTED", "ESTABLISHED", "DISCONNECTED",
             "DEVICE_REMOVAL", "MULTICAST_JOIN", "MULTICAST_ERROR", "ADDR_CHANGE", "TIMEWAIT_EXIT"]
# enum ib_cm_event_type (include/rdma/ib_cm.h), for cm_req_handler
IB_CM_EVENTS = ["REQ_ERROR", "REQ_RECEIVED", "REP_ERROR", "REP_RECEIVED", "RTU_RECEIVED", "USER_ESTABLISHED",
                "DREQ_ERROR", "DREQ_RECEIVED", "DREP_RECEIVED", "TIMEWAIT_EXIT", "MRA_RECEIVED", "REJ_RECEIVED",
                "LAP_ERROR", "LAP_RECEIVED", "APR_RECEIVED", "SIDR_REQ_ERROR", "SIDR_REQ_RECEIVED", "SIDR_REP_RECEIVED"]
POLL_CTX = ["DIRECT", "SOFTIRQ", "WORKQUEUE", "UNBOUND_WORKQUEUE"]
QP_TYPES = {0: "SMI", 1: "GSI", 2: "RC", 3: "UC", 4: "UD", 5: "RAW_IPV6", 6: "RAW_ETHERTYPE", 8: "RAW_PACKET",
            9: "XRC_INI", 10: "XRC_TGT"}
SYSTEM = {n: ("rdma_core" if n.startswith("cq_") else "rdma_cma") for n in list(TYPES) + list(CORE_COUNTED)}


def config(tp) -> tuple[list[str], str | None]:
    flags = [f"-DKV_RDMA_TP_{ev.upper()}" for ev, system in SYSTEM.items() if tp(system, ev)]
    if not flags:
        return [], ("rdma_cma and rdma_core tracepoints not in this kernel (no InfiniBand/RDMA stack, "
                    "or ib_core/rdma_cm not loaded)")
    return flags, None


def sockaddr_str(raw: np.ndarray) -> str:
    """A sockaddr_in/sockaddr_in6 (28 bytes) as 'ip:port' ('' when unset)."""
    b = bytes(raw.tolist())
    family = b[0] | b[1] << 8
    port = int.from_bytes(b[2:4], "big")
    try:
        if family == 2:
            return f"{ipaddress.IPv4Address(b[4:8])}:{port}"
        if family == 10:
            a = ipaddress.IPv6Address(b[8:24])
            return f"[{a.ipv4_mapped or a}]:{port}"
    except ValueError:
        pass
    return "" if family == 0 else f"family{family}"


def cm_event_name(typ: int, ev: int) -> str:
    if typ in (1, 2):
        return CM_EVENTS[ev] if ev < len(CM_EVENTS) else str(ev)
    if typ == 13:
        return IB_CM_EVENTS[ev] if ev < len(IB_CM_EVENTS) else str(ev)
    return ""


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    typ = a["type"].tolist()
    is_cq = np.array([t in (20, 21) for t in typ], dtype=bool)
    is_qp = np.array([t == 11 for t in typ], dtype=bool)
    av, bv, cv, dv = (a[k].astype(np.int64) for k in ("a", "b", "c", "d"))
    return pa.table({
        "ts_ns": pa.array(a["ts"], pa.uint64()),
        "event": pa.array([NAMES.get(t, str(t)) for t in typ], pa.string()),
        "id": pa.array(a["id"], pa.uint32()),
        "cm_event": pa.array([cm_event_name(t, e) for t, e in zip(typ, a["event"].tolist())], pa.string()),
        "status": pa.array(a["status"], pa.int32()),
        "tos": pa.array(a["tos"], pa.uint32()),
        "qp_num": pa.array(a["qp_num"], pa.uint32()),
        "src": pa.array([sockaddr_str(x) for x in a["srcaddr"]], pa.string()),
        "dst": pa.array([sockaddr_str(x) for x in a["dstaddr"]], pa.string()),
        "nr_cqe": pa.array(av, pa.int64(), mask=~is_cq),
        "comp_vector": pa.array(bv, pa.int64(), mask=~is_cq),
        "poll_ctx": pa.array([POLL_CTX[c] if t in (20, 21) and c < len(POLL_CTX) else "" for t, c in zip(typ, cv.tolist())], pa.string()),
        "send_wr": pa.array(bv, pa.int64(), mask=~is_qp),
        "recv_wr": pa.array(cv, pa.int64(), mask=~is_qp),
        "qp_type": pa.array([QP_TYPES.get(d, str(d)) if t == 11 else "" for t, d in zip(typ, dv.tolist())], pa.string()),
        "pid": pa.array(a["tgid"], pa.uint32()),
        "tid": pa.array(a["tid"], pa.uint32()),
        "comm": pa.array(cstr(a["comm"]), pa.string()),
    })
