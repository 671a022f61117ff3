"""NVMe commands beyond their time overlap: the KV transfer whose thread issued one (the block
layer's issuer) while that transfer ran (thread_time), and per step the latency of the commands
overlapping it and the commands per (step, controller, queue, op class) for the chunks' spans."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import Context, thread_match
from kvtrace.correlate.stages.overlap import Overlaps
from kvtrace.correlate.stages.transfers import Transfers

NVME_COLS = {"ts_ns": "u8", "setup_ns": "u8", "latency_ns": "i8", "pid": "u4", "tid": "u4", "qid": "u4", "bytes": "u8",
             "status": "u4", "weight": "u4", "sq_occupancy": "i8"}
NVME_TEXT = ("ctrl", "transport", "traddr", "opclass")


def nvme_rows(table: pa.Table | None) -> Cols | None:
    """nvme_cmd's columns the spans and thread matching need (weight 0 or missing = 1)."""
    if table is None or table.num_rows == 0:
        return None
    import pyarrow.compute as pc

    out = Cols()
    for c, dt in NVME_COLS.items():
        out[c] = (table[c].fill_null(0).to_numpy(zero_copy_only=False).astype(dt) if c in table.column_names
                  else np.zeros(table.num_rows, dt))
    out["has_occ"] = (pc.is_valid(table["sq_occupancy"]).to_numpy(zero_copy_only=False)
                      if "sq_occupancy" in table.column_names else np.zeros(table.num_rows, bool))
    for c in NVME_TEXT:
        out[c] = (np.asarray(table[c].cast(pa.string()).fill_null("").to_pylist(), dtype=object) if c in table.column_names
                  else np.full(table.num_rows, "", dtype=object))
    out["weight"] = np.maximum(out["weight"], 1)
    out["setup_ns"] = np.where(out["setup_ns"] > 0, out["setup_ns"], out["ts_ns"])
    # a command that ended without its completion traced (latency null): its end is unknown, so
    # it is placed at its setup and left out of latencies
    out["timed"] = (pc.is_valid(table["latency_ns"]).to_numpy(zero_copy_only=False)
                    if "latency_ns" in table.column_names else np.ones(table.num_rows, bool))
    out["ts_ns"] = np.where(out["timed"], out["ts_ns"], out["setup_ns"])
    out.n = table.num_rows
    return out


def issuer_match(nv: Cols, tr: Cols, tr_named: np.ndarray) -> np.ndarray:
    """Per NVMe command: the KV transfer whose thread issued it (the block layer's issuer) while
    that transfer ran, named transfers first; -1 if none (or the issuer is unknown, tid 0)."""
    return thread_match(nv["pid"], nv["tid"], nv["setup_ns"], nv["tid"] != 0, tr, tr_named)


@dataclass
class Nvme:
    nv: Cols | None          # the nvme_cmd rows (None: no such table, or empty)
    transfer: np.ndarray     # per command: the issuing transfer (thread_time), -1 if none
    pending: np.ndarray | None  # per command: issued by a transfer this pass does not finalise


def nvme_commands(ctx: Context, transfers: Transfers) -> Nvme:
    nv = nvme_rows(ctx.tables.get("nvme_cmd"))
    if nv is None:
        return Nvme(None, np.zeros(0, np.int64), None)
    nv_transfer = issuer_match(nv, transfers.tr, transfers.named)
    # a command issued by a transfer's thread stays until that transfer is decided
    pend = ((nv_transfer >= 0) & ~transfers.final[np.maximum(nv_transfer, 0)] if transfers.n
            else np.zeros(nv.n, bool))
    return Nvme(nv, nv_transfer, pend)


def nvme_group(nv: Cols, r: int, transfer: int | None = None) -> dict:
    """An empty aggregate of NVMe commands like row r (its controller, queue and op class)."""
    return {"kind": "nvme_cmd", "transfer": transfer, "single": False, "ctrl": nv["ctrl"][r], "qid": int(nv["qid"][r]),
            "opclass": nv["opclass"][r], "transport": nv["transport"][r], "traddr": nv["traddr"][r],
            "device": f"{nv['ctrl'][r]} q{int(nv['qid'][r])} {nv['opclass'][r]}", "read": nv["opclass"][r] == "read",
            "start_ns": int(nv["setup_ns"][r]), "end_ns": int(nv["ts_ns"][r]), "first_start_ns": int(nv["setup_ns"][r]),
            "count": 0, "samples": 0, "bytes": 0, "latency_ns_sum": 0, "latency_ns_max": 0, "errors": 0,
            "sq_occ_sum": 0, "sq_occ_n": 0}


def nvme_add(g: dict, nv: Cols, r: int) -> None:
    """Add command r (with its sampling weight) to the aggregate g."""
    w = int(nv["weight"][r])
    lat = int(nv["latency_ns"][r])
    g["count"] += w
    g["samples"] += 1
    g["bytes"] += w * int(nv["bytes"][r])
    if nv["timed"][r]:
        g["latency_ns_sum"] += w * lat
        g["latency_ns_max"] = max(g["latency_ns_max"], lat)
    else:
        g["untraced"] = g.get("untraced", 0) + w
    g["errors"] += w * (int(nv["status"][r]) != 0)
    g["start_ns"] = min(g["start_ns"], int(nv["setup_ns"][r]))
    g["first_start_ns"] = g["start_ns"]
    g["end_ns"] = max(g["end_ns"], int(nv["ts_ns"][r]))
    if nv["has_occ"][r]:
        g["sq_occ_sum"] += int(nv["sq_occupancy"][r])
        g["sq_occ_n"] += 1


@dataclass
class StepNvme:
    latency_avg: np.ndarray   # per step row: weighted mean latency of the (traced) commands overlapping it
    latency_max: np.ndarray
    groups: list[dict]        # per (step, ctrl, queue, op class) with final chunks: the chunks' kvtrace.nvme spans


def step_nvme(ctx: Context, nvme: Nvme, ov: Overlaps, chunks: Chunks) -> StepNvme:
    n, nv, steps = ctx.steps.n, nvme.nv, ctx.steps
    nv_w = np.zeros(n, np.float64)
    nv_lat = np.zeros(n, np.float64)
    nv_max = np.zeros(n, np.int64)
    nv_by: dict[tuple, dict] = {}
    for row, r in ov.nv_pairs:
        if nv["timed"][r]:   # a command that ended untraced has no latency
            w = float(nv["weight"][r])
            lat = int(nv["latency_ns"][r])
            nv_w[row] += w
            nv_lat[row] += w * lat
            nv_max[row] = max(nv_max[row], lat)
        g = nv_by.setdefault((row, nv["ctrl"][r], int(nv["qid"][r]), nv["opclass"][r]), nvme_group(nv, r))
        nvme_add(g, nv, r)
    nv_avg = np.divide(nv_lat, nv_w, out=np.zeros(n, np.float64), where=nv_w > 0)

    ch = chunks.ch
    chunks_of_step: dict[int, list] = {}
    for i in np.flatnonzero(chunks.final).tolist():
        if chunks.step[i] >= 0:
            chunks_of_step.setdefault(int(chunks.step[i]), []).append(
                (ch["request"][i], int(ch["attempt"][i]), int(ch["step"][i])))
    groups = []
    for (row, ctrl, qid, opclass), g in sorted(nv_by.items(), key=lambda kv: kv[0]):
        if chunks_of_step.get(row):
            g["chunks"] = chunks_of_step[row]
            g["step"] = int(steps["step"][row])
            # the span shows the part inside the step's window (its chunks' spans)
            g["start_ns"] = max(g["start_ns"], int(steps["t_start_ns"][row]))
            g["end_ns"] = max(min(g["end_ns"], int(steps["t_end_ns"][row])), g["start_ns"])
            groups.append(g)
    return StepNvme(nv_avg, nv_max, groups)
