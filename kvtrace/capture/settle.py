"""Requests left open at a clean stop, settled against the kernel's in-flight counts.

The kernel does not run a tracepoint's BPF program that interrupts another BPF program on
the same CPU (a completion in softirq on top of a traced system call, say), so now and then a
probe does not see a completion.  For NVMe, the probe finds out while the capture runs, when
the command's tag is set up again (probes/nvme.bpf.c counts it `unseen`).  At the stop the
last commands of a queue, and block requests (keyed by sector, never set up again), have no
such next event: those still in the probe's start map on a device with nothing in flight
(``/sys/block/<disk>/inflight``) ended without their completion traced.  A busy device's
requests get ``timeout`` seconds to complete (traced as usual); what is still open then is
counted, not guessed.  NVMe admin commands have no disk to ask and are left open.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvtrace.capture import blockio, nvme
from kvtrace.capture.events import KIND_BLOCK, DecodeContext, map_items as _items

NVME_FIELDS = ("ts", "slba", "nsid", "nlb", "bytes", "tgid", "tid", "setup_tid", "cid", "opcode", "fctype", "flags",
               "issuer", "xflags")
BLOCK_FIELDS = ("ts_start", "ts_issue", "tgid", "tid", "bytes", "from_dev")


def inflight(root: str, disk: str) -> int | None:
    """Requests in flight on a disk (reads + writes), None if the kernel does not say."""
    try:
        return sum(int(x) for x in Path(root, "sys/block", disk, "inflight").read_text().split())
    except (OSError, ValueError):
        return None


def settle(table, read, is_idle, timeout: float = 1.0, sleep=time.sleep,
           clock=time.monotonic) -> tuple[list[tuple[tuple, dict]], int]:
    """Remove and return the open requests that ended untraced, [(key, record)], and how many
    stay open.  ``read(table)`` gives {key: (map key, record)} with the device first in key;
    ``is_idle(device)`` says whether it has nothing in flight."""
    deadline = clock() + timeout
    ended: list[tuple[tuple, dict]] = []
    while True:
        first = read(table)
        quiet = {d for d in {k[0] for k in first} if is_idle(d)}
        # still open, unchanged, after the device said it had nothing in flight: ended
        again = read(table)
        for key, (mk, rec) in first.items():
            if key[0] in quiet and key in again and again[key][1] == rec:
                try:
                    del table[mk]
                except KeyError:   # completed (traced) just now
                    continue
                ended.append((key, rec))
                del again[key]
        if not again or clock() >= deadline:
            return ended, len(again)
        sleep(0.02)


# ----------------------------------------------------------------------------- NVMe


def open_commands(table) -> dict[tuple, tuple]:
    """nvme_start: (ctrl_id, qid, tag) -> (map key, setup record) for I/O-queue commands."""
    out = {}
    for k, v in _items(table):
        key = (int(k.ctrl_id), int(k.qid), int(k.tag))
        if key[1] == 0:
            continue
        rec = {f: int(getattr(v, f)) for f in NVME_FIELDS}
        rec["comm"] = bytes(getattr(v, "comm", b""))
        out[key] = (k, rec)
    return out


def ctrl_idle(ctrl, root: str) -> bool:
    """Every disk of the controller's namespaces (path and head) has nothing in flight."""
    disks = {d for ns in getattr(ctrl, "namespaces", ()) for d in (ns.disk, ns.head) if d}
    return bool(disks) and all(inflight(root, d) == 0 for d in disks)


def nvme_commands(table, ctrls: dict, root: str = "/", timeout: float = 1.0, **kw):
    return settle(table, open_commands, lambda c: c in ctrls and ctrl_idle(ctrls[c], root), timeout, **kw)


# ----------------------------------------------------------------------------- block


def open_requests(table) -> dict[tuple, tuple]:
    """block_start: (device asked, dev, sector) -> (map key, record) for requests issued to the
    device (a bio never issued may have been merged in a way the probe does not follow)."""
    out = {}
    for k, v in _items(table):
        rec = {f: int(getattr(v, f)) for f in BLOCK_FIELDS}
        if not rec["ts_issue"]:
            continue
        rec["rwbs"] = bytes(getattr(v, "rwbs", b""))
        rec["comm"] = bytes(getattr(v, "comm", b""))
        dev = int(k.dev)
        out[(dev or rec["from_dev"], dev, int(k.sector))] = (k, rec)
    return out


def block_requests(table, ctx: DecodeContext, root: str = "/", timeout: float = 1.0, **kw):
    def idle(dev: int) -> bool:
        name = ctx.dev_name(dev)
        return bool(name) and inflight(root, name) == 0
    return settle(table, open_requests, idle, timeout, **kw)


def block_rows(ended: list, now: int, ctx: DecodeContext) -> pa.Table | None:
    """block_io rows for requests that ended untraced: no error, latency or device time known."""
    if not ended:
        return None
    a = np.zeros(len(ended), dtype=blockio.DTYPE)
    for i, ((dev, kdev, sector), r) in enumerate(ended):
        a[i]["kind"], a[i]["version"], a[i]["size"], a[i]["ts"] = KIND_BLOCK, 1, blockio.DTYPE.itemsize, now
        a[i]["tgid"], a[i]["tid"], a[i]["ts_start"], a[i]["ts_issue"] = r["tgid"], r["tid"], r["ts_start"], r["ts_issue"]
        a[i]["sector"], a[i]["dev"], a[i]["bytes"], a[i]["weight"] = sector, kdev or dev, r["bytes"], 1
        a[i]["rwbs"], a[i]["comm"] = r["rwbs"][:8], r["comm"][:16]
    t = blockio.decode([a.tobytes()], ctx)
    for col in ("error", "device_ns", "latency_ns"):
        i = t.schema.get_field_index(col)
        t = t.set_column(i, col, pa.nulls(t.num_rows, t.schema.field(col).type))
    return t


def nvme_rows(ended: list, now: int, ctx: DecodeContext | None) -> tuple[dict, dict[str, pa.Table]]:
    """Per (ctrl, qid, opclass): [commands, bytes] of NVMe commands that ended untraced, and
    their nvme_cmd rows (no latency, no status)."""
    counts: dict[tuple, list] = {}
    raw = []
    for key, s in ended:
        oc = nvme.opclass_of(key[1], s["opcode"])
        nbytes = s["bytes"]
        if s["xflags"] & nvme.X_NS_UNKNOWN and nbytes:
            lba = nvme.lba_bytes(ctx, key[0], s["nsid"]) if ctx is not None else None
            nbytes = s["nlb"] * lba if lba else nbytes
        c = counts.setdefault((key[0], key[1], oc), [0, 0])
        c[0] += 1
        c[1] += nbytes
        raw.append(nvme.command_event(key, s, now, oc, nvme.REC_UNSEEN, 1).tobytes())
    return counts, (nvme.decode(raw, ctx if ctx is not None else DecodeContext()) if raw else {})
