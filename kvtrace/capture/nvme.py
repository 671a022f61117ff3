"""Decoder for probes/nvme.bpf.c: NVMe commands per controller and queue (table ``nvme_cmd``)
and asynchronous events (table ``nvme_async``).

The exact per-queue totals and latency histograms live in BPF maps and are read once per
flush by kvtrace.capture.kstats (tables ``nvme_queue`` and ``nvme_queue_hist``).

nvme.bpf.c's rules written again in Python, for the tests, are tests/bpf_reference.py's
NvmeReference.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_NVME, DecodeContext, cstr, decode_array, struct_dtype
from kvtrace.capture import tpformat

NAME = "nvme"
KIND = KIND_NVME
SOURCE = "nvme.bpf.c"
STRUCT = "kv_nvme_event"
TABLE = "nvme_cmd"
ASYNC_TABLE = "nvme_async"
DTYPE = struct_dtype(
    [
        ("ts_setup", "<u8"),
        ("slba", "<u8"),
        ("result", "<u8"),
        ("ctrl_id", "<u4"),
        ("nsid", "<u4"),
        ("nlb", "<u4"),
        ("bytes", "<u4"),
        ("weight", "<u4"),
        ("qid", "<u2"),
        ("cid", "<u2"),
        ("status", "<u2"),
        ("sq_occ", "<u2"),
        ("opcode", "u1"),
        ("fctype", "u1"),
        ("flags", "u1"),
        ("retries", "u1"),
        ("rec", "u1"),
        ("issuer", "u1"),
        ("opclass", "u1"),
        ("xflags", "u1"),
        ("setup_tid", "<u4"),
        ("disk", "S32"),
        ("comm", "S16"),
    ]
)

# KV_NVME_OP_* (probes/nvme.bpf.c)
OPCLASSES = ["read", "write", "flush", "other", "admin", "fabrics", "unknown", "queue"]
OP_UNKNOWN, OP_QUEUE = 6, 7
REC_CMD, REC_AEN, REC_UNSEEN = 0, 1, 2   # REC_UNSEEN: a command that ended without its completion traced
UNSEEN_TEXT = "ended, completion not traced"
X_NS_UNKNOWN = 0x1   # KV_NVME_X_NS_UNKNOWN: the namespace was not in nvme_ns at setup (bytes = nlb << 9)
ISSUERS = ["", "block", "setup"]
MODES = {"sampled": 0, "all": 1, "none": 2}
NO_OCC = 0xFFFF
WINDOW_NS = 100_000_000
MAX_SHIFT = 24

# NVM command set opcodes (I/O queues) and admin opcodes (qid 0); fabrics commands are 0x7f.
IO_OPCODES = {
    0x00: "flush", 0x01: "write", 0x02: "read", 0x04: "write_uncor", 0x05: "compare",
    0x08: "write_zeroes", 0x09: "dsm", 0x0C: "verify", 0x0D: "resv_register", 0x0E: "resv_report",
    0x11: "resv_acquire", 0x15: "resv_release", 0x19: "copy", 0x79: "zone_mgmt_send",
    0x7A: "zone_mgmt_recv", 0x7D: "zone_append",
}
ADMIN_OPCODES = {
    0x00: "delete_sq", 0x01: "create_sq", 0x02: "get_log_page", 0x04: "delete_cq", 0x05: "create_cq",
    0x06: "identify", 0x08: "abort", 0x09: "set_features", 0x0A: "get_features",
    0x0C: "async_event", 0x0D: "ns_mgmt", 0x10: "fw_commit", 0x11: "fw_download",
    0x14: "device_self_test", 0x15: "ns_attach", 0x18: "keep_alive", 0x19: "directive_send",
    0x1A: "directive_recv", 0x7C: "dbbuf", 0x80: "format_nvm", 0x81: "security_send",
    0x82: "security_recv", 0x84: "sanitize", 0x86: "get_lba_status",
}
FABRICS_TYPES = {0x00: "property_set", 0x01: "connect", 0x04: "property_get", 0x05: "auth_send",
                 0x06: "auth_receive", 0x08: "disconnect"}
LBA_OPCODES = {0x01, 0x02, 0x04, 0x05, 0x08, 0x0C, 0x7D}
DATA_OPCODES = {0x01, 0x02, 0x05, 0x7D}

# nvme_req(req)->status: SC in bits 0-7, SCT 8-10, CRD 11-12, More 13, DNR 14 (host-side
# codes 0x37x are the driver's own: path error, aborted by the host).
STATUS_TEXT = {
    0x0000: "success", 0x0001: "invalid opcode", 0x0002: "invalid field", 0x0004: "data transfer error",
    0x0006: "internal error", 0x0007: "abort requested", 0x0008: "aborted: SQ deleted",
    0x000B: "invalid namespace or format", 0x0080: "LBA out of range", 0x0081: "capacity exceeded",
    0x0082: "namespace not ready", 0x0280: "write fault", 0x0281: "unrecovered read error",
    0x0287: "access denied", 0x0301: "ANA persistent loss", 0x0302: "ANA inaccessible",
    0x0303: "ANA transition", 0x0370: "host path error", 0x0371: "aborted by host",
}
AEN_TYPES = {0: "error", 1: "smart", 2: "notice", 6: "io_command_set", 7: "vendor"}
AEN_NOTICES = {0x00: "namespace attributes changed", 0x01: "firmware activation starting",
               0x02: "telemetry log changed", 0x03: "ANA change", 0x04: "predictable latency change",
               0x05: "LBA status information", 0x06: "endurance group event",
               0xF0: "discovery log page changed"}

REQUIRED = {
    "nvme_setup_cmd": ("ctrl_id", "qid", "opcode", "flags", "cid", "nsid", "cdw10"),
    "nvme_complete_rq": ("ctrl_id", "qid", "cid", "retries", "flags", "status"),
}


def _default_fields(system: str, event: str):

    return tpformat.field_names(system, event)


def config(tp, fields=None) -> tuple[list[str], str | None]:
    """Compile flags for this kernel's nvme tracepoints, or why the probe is skipped.

    ``fields(system, event)`` gives the field names of a tracepoint (None when its format
    cannot be read; the current upstream layout is then assumed).
    """
    if not (tp("nvme", "nvme_setup_cmd") and tp("nvme", "nvme_complete_rq")):
        return [], "nvme:nvme_setup_cmd/nvme_complete_rq not in this kernel (no NVMe driver, or nvme_core not loaded)"
    fields = fields or _default_fields
    flags = []
    have = {ev: fields("nvme", ev) for ev in REQUIRED}
    for ev, need in REQUIRED.items():
        if have[ev] is not None:
            missing = [f for f in need if f not in have[ev]]
            if missing:
                return [], f"nvme:{ev} has no {', '.join(missing)} in this kernel's layout"
    if have["nvme_setup_cmd"] is None or "fctype" in have["nvme_setup_cmd"]:
        flags.append("-DKV_NVME_HAVE_FCTYPE")
    if have["nvme_complete_rq"] is None or "disk" in have["nvme_complete_rq"]:
        flags.append("-DKV_NVME_HAVE_DISK")
    if tp("nvme", "nvme_sq"):
        sq = fields("nvme", "nvme_sq")
        if sq is None or {"ctrl_id", "qid", "sq_head", "sq_tail"} <= sq:
            flags.append("-DKV_NVME_HAVE_SQ")
    if tp("nvme", "nvme_async_event"):
        flags.append("-DKV_NVME_HAVE_AEN")
    return flags, None


def opname(qid: int, opcode: int, fctype: int) -> str:
    if opcode == 0x7F:
        if fctype == 0xFF:
            return "fabrics"   # the kernel's tracepoint has no fctype
        return FABRICS_TYPES.get(fctype, f"fabrics_{fctype:#x}")
    if qid == 0:
        return ADMIN_OPCODES.get(opcode, f"admin_{opcode:#x}")
    return IO_OPCODES.get(opcode, f"io_{opcode:#x}")


def opclass_of(qid: int, opcode: int) -> int:
    if opcode == 0x7F:
        return 5
    if qid == 0:
        return 4
    return {0x02: 0, 0x01: 1, 0x00: 2}.get(opcode, 3)


def status_text(status: int) -> str:
    code = status & 0x7FF
    text = STATUS_TEXT.get(code, f"sct {code >> 8:#x} sc {code & 0xFF:#x}")
    if status & 0x4000:
        text += " (do not retry)"
    return text


def aen_text(result: int) -> tuple[str, str]:
    typ, info, _log = result & 0x7, (result >> 8) & 0xFF, (result >> 16) & 0xFF
    kind = AEN_TYPES.get(typ, f"type_{typ}")
    text = AEN_NOTICES.get(info, f"info {info:#x}") if typ == 2 else f"info {info:#x}"
    return kind, text


def lba_bytes(ctx: DecodeContext, ctrl_id: int, nsid: int) -> int | None:
    """The logical block size of a namespace, from the topology on the decode context."""
    lba = (getattr(ctx, "nvme_lba", None) or {}).get((ctrl_id, nsid))
    if lba:
        return lba
    c = (getattr(ctx, "nvme_ctrls", None) or {}).get(ctrl_id)
    for ns in (c.namespaces if c else ()):
        if ns.nsid == nsid and ns.lba_bytes:
            return ns.lba_bytes
    return None


def want_topology(ctx: DecodeContext, ctrl_ids=(), namespaces=()) -> None:
    """Records name these controllers (and namespaces, (ctrl_id, nsid)): if the topology does
    not list one, have the fabric sidecar rescan sysfs now (it rate-limits), so no row of a
    controller that is present is written without its transport, target and LBA size."""
    rescan = getattr(ctx, "nvme_rescan", None)
    if rescan is None:
        return
    ctrls = getattr(ctx, "nvme_ctrls", None) or {}
    missing_c = sorted({int(c) for c in ctrl_ids} - set(ctrls))
    missing_n = sorted({(int(c), int(n)) for c, n in namespaces if lba_bytes(ctx, int(c), int(n)) is None})
    if missing_c or missing_n:
        rescan(ctrls=missing_c, namespaces=missing_n)


def _topo_cols(ctx: DecodeContext, ctrl_ids) -> tuple[list[str], list[str]]:
    """Transport and target address per controller, from the topology the fabric sidecar put
    on the shared decode context (absent: empty strings)."""
    ctrls = getattr(ctx, "nvme_ctrls", None) or {}
    transport, traddr = [], []
    for c in ctrl_ids:
        info = ctrls.get(int(c))
        transport.append(info.transport if info else "")
        traddr.append(info.target if info else "")
    return transport, traddr


def command_bytes(cmd: np.ndarray, ctx: DecodeContext) -> np.ndarray:
    """Data bytes per command: as the probe counted them, except for commands whose namespace
    the probe did not know yet (X_NS_UNKNOWN: counted in 512-byte LBAs), recomputed as
    nlb * the namespace's LBA size where the topology knows it."""
    out = cmd["bytes"].astype(np.uint64)
    fix = np.nonzero(((cmd["xflags"] & X_NS_UNKNOWN) != 0) & (cmd["bytes"] > 0))[0]
    if len(fix):
        ctrl, nsid, nlb = cmd["ctrl_id"].tolist(), cmd["nsid"].tolist(), cmd["nlb"].tolist()
        for i in fix.tolist():
            lba = lba_bytes(ctx, ctrl[i], nsid[i])
            if lba:
                out[i] = nlb[i] * lba
    return out


def _disks(cmd: np.ndarray, unseen: np.ndarray, ctx: DecodeContext) -> list[str]:
    """The disk each command was on: from the completion, or for one that ended untraced (no
    completion record) the namespace's disk in the topology."""
    out = cstr(cmd["disk"])
    if unseen.any():
        ctrls = getattr(ctx, "nvme_ctrls", None) or {}
        for i in np.flatnonzero(unseen).tolist():
            c = ctrls.get(int(cmd["ctrl_id"][i]))
            out[i] = next((ns.disk for ns in (c.namespaces if c else ()) if ns.nsid == int(cmd["nsid"][i])), "")
    return out


def decode(raw: list[bytes], ctx: DecodeContext) -> dict[str, pa.Table]:
    a = decode_array(raw, DTYPE)
    out = {}
    cmd = a[(a["rec"] == REC_CMD) | (a["rec"] == REC_UNSEEN)]
    aen = a[a["rec"] == REC_AEN]
    if len(a):
        unknown = (a["rec"] != REC_AEN) & ((a["xflags"] & X_NS_UNKNOWN) != 0)
        want_topology(ctx, np.unique(a["ctrl_id"]).tolist(),
                      set(zip(a["ctrl_id"][unknown].tolist(), a["nsid"][unknown].tolist())))
    if len(cmd):
        end = cmd["ts"].astype(np.int64)
        start = cmd["ts_setup"].astype(np.int64)
        qid, opc, fct = cmd["qid"].tolist(), cmd["opcode"].tolist(), cmd["fctype"].tolist()
        status = cmd["status"].tolist()
        unseen = cmd["rec"] == REC_UNSEEN   # no completion: no latency, no status
        occ = cmd["sq_occ"]
        transport, traddr = _topo_cols(ctx, cmd["ctrl_id"])
        out[TABLE] = pa.table({
            "ts_ns": pa.array(cmd["ts"], pa.uint64()),
            "setup_ns": pa.array(cmd["ts_setup"], pa.uint64()),
            "latency_ns": pa.array(end - start, pa.int64(), mask=unseen),
            "pid": pa.array(cmd["tgid"], pa.uint32()),
            "tid": pa.array(cmd["tid"], pa.uint32()),
            "comm": pa.array(cstr(cmd["comm"]), pa.string()),
            "issuer": pa.array([ISSUERS[i] if i < len(ISSUERS) else "" for i in cmd["issuer"].tolist()], pa.string()),
            "setup_tid": pa.array(cmd["setup_tid"], pa.uint32()),
            "ctrl_id": pa.array(cmd["ctrl_id"], pa.uint32()),
            "ctrl": pa.array([f"nvme{c}" for c in cmd["ctrl_id"].tolist()], pa.string()),
            "transport": pa.array(transport, pa.string()),
            "traddr": pa.array(traddr, pa.string()),
            "qid": pa.array(cmd["qid"], pa.uint32()),
            "cid": pa.array(cmd["cid"], pa.uint32()),
            "disk": pa.array(_disks(cmd, unseen, ctx), pa.string()),
            "nsid": pa.array(cmd["nsid"], pa.uint32()),
            "opcode": pa.array(cmd["opcode"], pa.uint32()),
            "op": pa.array([opname(q, o, f) for q, o, f in zip(qid, opc, fct)], pa.string()),
            "opclass": pa.array([OPCLASSES[c] if c < len(OPCLASSES) else "" for c in cmd["opclass"].tolist()], pa.string()),
            "slba": pa.array(cmd["slba"], pa.uint64()),
            "nlb": pa.array(cmd["nlb"], pa.uint32()),
            "bytes": pa.array(command_bytes(cmd, ctx), pa.uint64()),
            "status": pa.array(cmd["status"], pa.uint32(), mask=unseen),
            "status_text": pa.array([UNSEEN_TEXT if u else status_text(s) for s, u in zip(status, unseen.tolist())],
                                    pa.string()),
            "retries": pa.array(cmd["retries"], pa.uint32()),
            "flags": pa.array(cmd["flags"], pa.uint32()),
            "sq_occupancy": pa.array(occ.astype(np.int32), pa.int32(), mask=occ == NO_OCC),
            "weight": pa.array(cmd["weight"], pa.uint32()),
        })
    if len(aen):
        kinds, texts = zip(*(aen_text(int(r)) for r in aen["result"].tolist()))
        transport, traddr = _topo_cols(ctx, aen["ctrl_id"])
        out[ASYNC_TABLE] = pa.table({
            "ts_ns": pa.array(aen["ts"], pa.uint64()),
            "ctrl_id": pa.array(aen["ctrl_id"], pa.uint32()),
            "ctrl": pa.array([f"nvme{c}" for c in aen["ctrl_id"].tolist()], pa.string()),
            "transport": pa.array(transport, pa.string()),
            "traddr": pa.array(traddr, pa.string()),
            "result": pa.array(aen["result"].astype(np.uint32), pa.uint32()),
            "type": pa.array(list(kinds), pa.string()),
            "event": pa.array(list(texts), pa.string()),
        })
    return out


def command_event(key: tuple, s: dict, ts: int, opclass: int, rec: int, weight: int, cpu: int = 0) -> np.ndarray:
    """A kv_nvme_event record built from a command's setup record (nvme_start's fields), as
    the probe fills it before a completion adds status, flags, retries and disk."""
    e = np.zeros(1, dtype=DTYPE)
    e["kind"], e["version"], e["size"], e["cpu"], e["ts"] = KIND_NVME, 1, DTYPE.itemsize, cpu, ts
    e["tgid"], e["tid"], e["ts_setup"], e["slba"] = s["tgid"], s["tid"], s["ts"], s["slba"]
    e["ctrl_id"], e["nsid"], e["nlb"], e["bytes"], e["weight"] = key[0], s["nsid"], s["nlb"], s["bytes"], weight
    e["qid"], e["cid"], e["sq_occ"] = key[1], s["cid"], NO_OCC
    e["opcode"], e["fctype"] = s["opcode"], s["fctype"]
    e["rec"], e["issuer"], e["opclass"], e["setup_tid"] = rec, s["issuer"], opclass, s["setup_tid"]
    e["xflags"], e["comm"] = s["xflags"], s["comm"][:16]
    return e
