"""NVMe commands (nvme_cmd: setup -> completion, weighted by their sampling weight) and NIC
counter deltas (nic_counters: the polling interval before ts_ns) go to every step their
interval overlaps (time_overlap), with share = the overlapped fraction of the interval."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtrace.correlate.inputs import OVERLAP_PREFIXES, Cols, overlap_columns
from kvtrace.correlate.stages.context import MAXBACK, Context


@dataclass
class Overlaps:
    nvme_cmds: np.ndarray     # per step row: NVMe commands (weighted, by share)
    nvme_bytes: np.ndarray    # per step row: their bytes
    nic: list[dict]           # per step row: NIC counter -> delta (by share)
    attr: list[tuple] = field(default_factory=list)   # (table, end, start, step row, share) per final overlap
    done: dict[str, np.ndarray] = field(default_factory=dict)   # per overlap table: rows decided
    nv_pairs: list[tuple[int, int]] = field(default_factory=list)  # (step row, nvme_cmd row) per final overlap


def overlaps(ctx: Context) -> Overlaps:
    n = ctx.steps.n
    out = Overlaps(np.zeros(n, np.float64), np.zeros(n, np.float64), [dict() for _ in range(n)])
    tables = ctx.tables
    for name in sorted(tables):
        if not name.startswith(OVERLAP_PREFIXES) or tables[name] is None or tables[name].num_rows == 0:
            continue
        x = overlap_columns(tables[name])
        if x is None:
            continue
        out.done[name] = overlap_table(ctx, name, x, out)
    return out


def overlap_table(ctx: Context, name: str, x: Cols, out: Overlaps) -> np.ndarray:
    """Add one NVMe/NIC table's overlaps with the final steps to ``out``; returns its rows decided.

    One loop over (row, overlapping step) pairs, kept in one function: it is the pass's inner
    loop on NVMe-heavy runs."""
    final, horizon = ctx.final, ctx.horizon
    nvme_cmds, nvme_bytes, nic, overlap_attr, nv_pairs = out.nvme_cmds, out.nvme_bytes, out.nic, out.attr, out.nv_pairs
    done = np.zeros(x.n, bool)
    latest_end = {e: (t1.max() if len(t1) else 0) for e, (_, _, t1) in ctx.index.engines.items()}
    for e, (sel, t0, t1) in ctx.index.engines.items():
        lo = np.searchsorted(t0, x["start"], "right") - 1 - MAXBACK
        hi = np.searchsorted(t0, x["end"], "right")
        for r in range(x.n):
            s0, s1 = int(x["start"][r]), int(x["end"][r])
            length = max(s1 - s0, 1)
            for j in range(max(int(lo[r]), 0), int(hi[r])):
                a, b = max(s0, int(t0[j])), min(s1, int(t1[j]))
                point = s0 == s1 and t0[j] <= s0 <= t1[j]
                if b <= a and not point:
                    continue
                row = int(sel[j])
                share = 1.0 if point else (b - a) / length
                if not final[row]:
                    continue
                overlap_attr.append((name, s1, s0, row, share))
                if name.startswith("nvme"):
                    nv_pairs.append((row, r))
                    weight = x["n:weight"][r] if "n:weight" in x and x["n:weight"][r] > 0 else 1.0
                    nvme_cmds[row] += share * weight
                    if "n:bytes" in x:
                        nvme_bytes[row] += share * weight * x["n:bytes"][r]
                else:
                    key = next((str(x[k][r]) for k in ("s:counter", "s:name", "s:metric") if k in x), name)
                    if "s:device" in x or "s:port" in x:
                        key = f"{x.get('s:device', x.get('s:port'))[r]}/{key}"
                    val = next((x[k][r] for k in ("n:delta", "n:value") if k in x), None)
                    if val is not None:
                        nic[row][key] = nic[row].get(key, 0.0) + share * float(val)
        done |= x["end"] < min(int(latest_end[e]), int(horizon))
    if not ctx.index.engines:
        done |= x["end"] < horizon
    return done
