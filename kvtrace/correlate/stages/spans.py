"""What the span builders (kvtrace.otlp) need beyond the tables: the final KV transfers with
their step, request and chunk, and their kernel I/O and NVMe commands as groups (one span each:
block I/O of at least io_span_bytes alone, the rest aggregated per transfer, device and
direction; NVMe commands per transfer, controller, queue and op class)."""
from __future__ import annotations

import numpy as np

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import HOW, Context
from kvtrace.correlate.stages.nvme import Nvme, nvme_add, nvme_group
from kvtrace.correlate.stages.storage_io import KernelIO
from kvtrace.correlate.stages.transfers import Transfers


def transfer_spans(ctx: Context, chunks: Chunks, transfers: Transfers) -> tuple[list[dict], dict[int, int]]:
    """The final transfers (as dicts), and transfer row -> position in that list."""
    steps, ch, tr = ctx.steps, chunks.ch, transfers.tr
    out, tindex = [], {}
    for i in np.flatnonzero(transfers.final).tolist():
        s, j = int(transfers.step[i]), int(transfers.chunk[i])
        r = tr["request"][i]
        d = {"row": i, "dir": tr["dir"][i], "pid": int(tr["pid"][i]), "tid": int(tr["tid"][i]),
             "t_start_ns": int(tr["t_start_ns"][i]), "t_end_ns": int(tr["t_end_ns"][i]),
             "seq": int(tr["seq"][i]), "blocks": int(tr["blocks"][i]), "nbytes": int(tr["nbytes"][i]),
             "wait_ns": int(tr["wait_ns"][i]), "source": tr["source"][i], "request": r,
             "how": HOW[int(transfers.how[i])],
             "engine_pid": int(steps["pid"][s]) if s >= 0 else 0, "step": int(steps["step"][s]) if s >= 0 else None,
             "attempt": int(ch["attempt"][j]) if j >= 0 else None, "chunk_index": int(ch["chunk_index"][j]) if j >= 0 else None,
             "chunk_step": int(ch["step"][j]) if j >= 0 else None}
        tindex[i] = len(out)
        out.append(d)
    return out, tindex


def io_group(name: str, transfer: int | None, x: Cols, t: np.ndarray, rows: np.ndarray, device: str, read: bool,
             single: bool) -> dict:
    """One span's worth of kernel I/O rows (of table ``name``) of one transfer."""
    b = x["bytes"][rows].astype(np.int64)
    lat = x["latency_ns"][rows].astype(np.int64)
    g = {"kind": name, "transfer": transfer, "single": single, "device": device, "read": read,
         "start_ns": int(t[rows].min()), "end_ns": int(x["ts_ns"][rows].max()), "count": len(rows),
         "bytes": int(b.sum()), "latency_ns_sum": int(lat.sum()), "latency_ns_max": int(lat.max()) if len(rows) else 0,
         "first_start_ns": int(t[rows].min())}
    if name == "block_io":
        g["queue_ns_sum"] = int(x["queue_ns"][rows].astype(np.int64).sum())
        g["device_ns_sum"] = int(x["device_ns"][rows].astype(np.int64).sum())
        g["errors"] = int((x["error"][rows] != 0).sum())
        if single:
            g["sector"] = int(x["sector"][rows[0]])
    elif name == "file_io":
        g["files"] = int(len(np.unique(x["path_code"][rows])))
        g["errors"] = int((x["ret"][rows] < 0).sum())
    else:
        g["errors"] = int((x["res"][rows] < 0).sum())
    return g


def kernel_io_groups(ctx: Context, kio: dict[str, KernelIO], tindex: dict[int, int]) -> list[dict]:
    """The final thread_time kernel I/O, grouped per transfer (transfer = position in tindex's list,
    None for a transfer this pass does not hand over)."""
    groups = []
    for name, k in kio.items():
        x = k.x
        sel = np.flatnonzero((k.transfer >= 0) & k.final)
        if not len(sel):
            continue
        trn = k.transfer[sel]
        # aggregate per (transfer, device/file kind, direction); big block I/O stays single
        if name == "block_io":
            big = x["bytes"][sel] >= ctx.io_span_bytes
            dev, names = x["disk_code"][sel], x["disks"]
        else:
            big = np.zeros(len(sel), bool)
            dev, names = np.zeros(len(sel), np.int32), np.array([""], dtype=object)
        rd = x["is_read"][sel]
        m = ~big
        if m.any():
            keys = np.stack([trn[m], dev[m].astype(np.int64), rd[m].astype(np.int64)], axis=1)
            uk, inv = np.unique(keys, axis=0, return_inverse=True)
            inv = inv.reshape(-1)
            idx_m = sel[m]
            order = np.argsort(inv, kind="stable")
            bounds = np.searchsorted(inv[order], np.arange(len(uk) + 1))
            for g in range(len(uk)):
                rows_g = idx_m[order[bounds[g]:bounds[g + 1]]]
                groups.append(io_group(name, tindex.get(int(uk[g][0])), x, k.t, rows_g, names[int(uk[g][1])],
                                       bool(uk[g][2]), single=False))
        for r in np.flatnonzero(big).tolist():
            groups.append(io_group(name, tindex.get(int(trn[r])), x, k.t, np.array([int(sel[r])]), names[dev[r]],
                                   bool(rd[r]), single=True))
    return groups


def nvme_transfer_groups(nvme: Nvme, transfers: Transfers, spans: list[dict], tindex: dict[int, int]) -> list[dict]:
    """NVMe commands issued by a final transfer's thread, per (transfer, controller, queue, op
    class), clipped to the transfer's interval."""
    nv = nvme.nv
    if nv is None or not transfers.n:
        return []
    by_tq: dict[tuple, dict] = {}
    for r in np.flatnonzero(nvme.transfer >= 0).tolist():
        t = tindex.get(int(nvme.transfer[r]))
        if t is None:
            continue
        g = by_tq.setdefault((t, nv["ctrl"][r], int(nv["qid"][r]), nv["opclass"][r]), nvme_group(nv, r, t))
        nvme_add(g, nv, r)
    out = []
    for k in sorted(by_tq):
        g, t = by_tq[k], spans[k[0]]
        g["start_ns"] = max(g["start_ns"], t["t_start_ns"])   # the part inside the transfer
        g["end_ns"] = max(min(g["end_ns"], t["t_end_ns"]), g["start_ns"])
        out.append(g)
    return out


def spans(ctx: Context, chunks: Chunks, transfers: Transfers, kio: dict[str, KernelIO],
          nvme: Nvme) -> tuple[list[dict], list[dict]]:
    """(final transfers, their I/O groups: kernel I/O then NVMe commands)."""
    tr_spans, tindex = transfer_spans(ctx, chunks, transfers)
    groups = kernel_io_groups(ctx, kio, tindex) + nvme_transfer_groups(nvme, transfers, tr_spans, tindex)
    return tr_spans, [g for g in groups if g["transfer"] is not None]
