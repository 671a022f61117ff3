"""Write tracepoint format files for the nvme, tcp/sock and rdma events of several kernels.

The layouts are the TP_STRUCT__entry lists of each kernel's headers
(drivers/nvme/host/trace.h, include/trace/events/{tcp,sock,rdma_core}.h,
drivers/infiniband/core/cma_trace.h), laid out with the x86-64 C rules the kernel's
format files report (natural alignment after the 8-byte common header).  The 6.18 tcp/sock
files are copies of the ones read on a 6.18 kernel (the 6.8+ layout: tcp_probe gained
skbaddr/skaddr, tcp_retransmit_skb gained err).

    python tests/data/tpformats/make.py     # rewrites tests/data/tpformats/<kernel>/events/
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON = [("unsigned short", "common_type", 2, 2, 0, 0), ("unsigned char", "common_flags", 1, 1, 0, 0),
          ("unsigned char", "common_preempt_count", 1, 1, 0, 0), ("int", "common_pid", 4, 4, 1, 0)]
# (ctype, name, element size, count (0 scalar), signed)
T = {"u8": (1, 0), "u16": (2, 0), "u32": (4, 0), "u64": (8, 0), "int": (4, 1), "bool": (1, 0), "char": (1, 0),
     "__u8": (1, 0), "__u16": (2, 0), "__u32": (4, 0), "__u64": (8, 0), "s64": (8, 1), "unsigned int": (4, 0),
     "unsigned long": (8, 0), "const void *": (8, 0), "unsigned char": (1, 0)}


def f(ctype, name, count=0):
    return (ctype, name, count)


NVME_SETUP_OLD = [f("char", "disk", 32), f("int", "ctrl_id"), f("int", "qid"), f("u8", "opcode"), f("u8", "flags"),
                  f("u16", "cid"), f("u32", "nsid"), f("u64", "metadata"), f("u8", "cdw10", 24)]
NVME_SETUP = [f("char", "disk", 32), f("int", "ctrl_id"), f("int", "qid"), f("u8", "opcode"), f("u8", "flags"),
              f("u8", "fctype"), f("u16", "cid"), f("u32", "nsid"), f("bool", "metadata"), f("u8", "cdw10", 24)]
NVME_COMPLETE = [f("char", "disk", 32), f("int", "ctrl_id"), f("int", "qid"), f("int", "cid"), f("u64", "result"),
                 f("u8", "retries"), f("u8", "flags"), f("u16", "status")]
NVME_AEN = [f("int", "ctrl_id"), f("u32", "result")]
NVME_SQ = [f("int", "ctrl_id"), f("char", "disk", 32), f("int", "qid"), f("u16", "sq_head"), f("u16", "sq_tail")]

TCP_SK_SKB = [f("const void *", "skbaddr"), f("const void *", "skaddr"), f("int", "state"), f("__u16", "sport"),
              f("__u16", "dport"), f("__u16", "family"), f("__u8", "saddr", 4), f("__u8", "daddr", 4),
              f("__u8", "saddr_v6", 16), f("__u8", "daddr_v6", 16)]
TCP_SYNACK = [f("const void *", "skaddr"), f("const void *", "req"), f("__u16", "sport"), f("__u16", "dport"),
              f("__u16", "family"), f("__u8", "saddr", 4), f("__u8", "daddr", 4), f("__u8", "saddr_v6", 16),
              f("__u8", "daddr_v6", 16)]
TCP_PROBE = [f("__u8", "saddr", 28), f("__u8", "daddr", 28), f("__u16", "sport"), f("__u16", "dport"),
             f("__u16", "family"), f("__u32", "mark"), f("__u16", "data_len"), f("__u32", "snd_nxt"),
             f("__u32", "snd_una"), f("__u32", "snd_cwnd"), f("__u32", "ssthresh"), f("__u32", "snd_wnd"),
             f("__u32", "srtt"), f("__u32", "rcv_wnd"), f("__u64", "sock_cookie")]
SET_STATE = [f("const void *", "skaddr"), f("int", "oldstate"), f("int", "newstate"), f("__u16", "sport"),
             f("__u16", "dport"), f("__u16", "family"), f("__u16", "protocol"), f("__u8", "saddr", 4),
             f("__u8", "daddr", 4), f("__u8", "saddr_v6", 16), f("__u8", "daddr_v6", 16)]

CQ_ID = [f("u32", "cq_id")]
RDMA_CORE = {
    "cq_schedule": CQ_ID, "cq_reschedule": CQ_ID, "cq_drain_complete": CQ_ID, "cq_free": CQ_ID,
    "cq_process": [f("u32", "cq_id"), f("bool", "interrupt"), f("s64", "latency")],
    "cq_poll": [f("u32", "cq_id"), f("int", "requested"), f("int", "rc")],
    "cq_modify": [f("u32", "cq_id"), f("unsigned int", "comps"), f("unsigned int", "usec")],
    "cq_alloc": [f("u32", "cq_id"), f("int", "nr_cqe"), f("int", "comp_vector"), f("unsigned long", "poll_ctx")],
    "cq_alloc_error": [f("int", "rc"), f("int", "nr_cqe"), f("int", "comp_vector"), f("unsigned long", "poll_ctx")],
}
ADDRS = [f("unsigned char", "srcaddr", 28), f("unsigned char", "dstaddr", 28)]
CMA_FSM = [f("u32", "cm_id"), f("u32", "tos")] + ADDRS
CMA_QP = [f("u32", "cm_id"), f("u32", "tos"), f("u32", "qp_num")] + ADDRS
RDMA_CMA = {
    **{f"cm_{n}": CMA_FSM for n in ("send_rtu", "send_rej", "send_mra", "send_sidr_req", "send_sidr_rep",
                                    "disconnect", "sent_drep", "sent_dreq", "id_destroy")},
    **{f"cm_{n}": CMA_QP for n in ("send_req", "send_rep", "qp_destroy")},
    "cm_qp_create": [f("u32", "cm_id"), f("u32", "pd_id"), f("u32", "tos"), f("u32", "qp_num"), f("u32", "send_wr"),
                     f("u32", "recv_wr"), f("int", "rc"), f("unsigned long", "qp_type")] + ADDRS,
    "cm_req_handler": [f("u32", "cm_id"), f("u32", "tos"), f("unsigned long", "event")] + ADDRS,
    "cm_event_handler": [f("u32", "cm_id"), f("u32", "tos"), f("unsigned long", "event"), f("int", "status")] + ADDRS,
    "cm_event_done": [f("u32", "cm_id"), f("u32", "tos"), f("unsigned long", "event"), f("int", "result")] + ADDRS,
}

NVME_NEW = {"nvme_setup_cmd": NVME_SETUP, "nvme_complete_rq": NVME_COMPLETE, "nvme_async_event": NVME_AEN,
            "nvme_sq": NVME_SQ}
NET = {"tcp/tcp_retransmit_skb": TCP_SK_SKB, "tcp/tcp_probe": TCP_PROBE, "sock/inet_sock_set_state": SET_STATE}
ADDED = {"tcp/tcp_retransmit_synack": (TCP_SYNACK, ("5.15", "6.1"))}   # later additions: IDs from 2000, the rest unchanged
KERNELS = {
    # 4.19-era layout: u64 metadata, no fctype (cdw10 moves to offset 64)
    "4.19": {"nvme": {"nvme_setup_cmd": NVME_SETUP_OLD, "nvme_complete_rq": NVME_COMPLETE,
                      "nvme_async_event": NVME_AEN, "nvme_sq": NVME_SQ}},
    "5.15": {"nvme": NVME_NEW, **NET, "rdma_core": RDMA_CORE, "rdma_cma": RDMA_CMA},
    "6.1": {"nvme": NVME_NEW, **NET, "rdma_core": RDMA_CORE, "rdma_cma": RDMA_CMA},
    "6.18": {"nvme": NVME_NEW, "rdma_core": RDMA_CORE, "rdma_cma": RDMA_CMA},  # tcp/sock: copied, see REAL_618
}
REAL_618 = ["tcp/tcp_retransmit_skb", "tcp/tcp_retransmit_synack", "tcp/tcp_probe", "sock/inet_sock_set_state"]


def layout(fields) -> list[str]:
    off = 8
    out = [f"\tfield:{c} {n};\toffset:{o};\tsize:{s};\tsigned:{g};" for (c, n, s, a, g, _), o in zip(COMMON, (0, 2, 3, 4))]
    out.append("")
    for ctype, name, count in fields:
        size, signed = T[ctype]
        off = (off + size - 1) // size * size
        total = size * (count or 1)
        decl = f"{ctype} {name}[{count}]" if count else f"{ctype} {name}"
        out.append(f"\tfield:{decl};\toffset:{off};\tsize:{total};\tsigned:{signed};")
        off += total
    return out


def write_format(path: Path, name: str, ident: int, fields) -> None:
    path.mkdir(parents=True, exist_ok=True)
    text = "\n".join([f"name: {name}", f"ID: {ident}", "format:", *layout(fields), "", 'print fmt: "(fixture)"', ""])
    (path / "format").write_text(text)


def main() -> None:
    ident = 1000
    for kernel, systems in KERNELS.items():
        for key, events in systems.items():
            if "/" in key:  # "system/event": one event
                system, event = key.split("/")
                ident += 1
                write_format(HERE / kernel / "events" / system / event, event, ident, events)
                continue
            for event, fields in events.items():
                ident += 1
                write_format(HERE / kernel / "events" / key / event, event, ident, fields)
    for ident, (key, (fields, kernels)) in enumerate(ADDED.items(), 2000):
        system, event = key.split("/")
        for kernel in kernels:
            write_format(HERE / kernel / "events" / system / event, event, ident, fields)
    for key in REAL_618:
        src = Path("/sys/kernel/tracing/events") / key / "format"
        dst = HERE / "6.18" / "events" / key / "format"
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(src.read_text())


if __name__ == "__main__":
    main()
