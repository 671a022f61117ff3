"""The attributions table: one row per placed (or unplaceable) event of the pass's final rows,
saying where it went and how (docs/correlate.md, the rules table).  Rows come in this order:
kernel storage I/O (block_io, file_io, io_uring), kv_load, kv_store, evict, preempt, NVMe
commands matched to a transfer's thread, then the time overlaps per NVMe/NIC table."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.chunks import Chunks
from kvtrace.correlate.stages.context import EXACT, HOW, OVERLAP, SHARED, THREAD, Context
from kvtrace.correlate.stages.evictions import Evictions, Preemptions
from kvtrace.correlate.stages.nvme import Nvme
from kvtrace.correlate.stages.overlap import Overlaps
from kvtrace.correlate.stages.storage_io import KernelIO
from kvtrace.correlate.stages.transfers import Transfers

_D = pa.dictionary(pa.int32(), pa.string())
ATTR_TYPES = {"source": _D, "ts_ns": pa.uint64(), "start_ns": pa.uint64(), "pid": pa.uint32(),
              "tid": pa.uint32(), "bytes": pa.uint64(), "engine_pid": pa.uint32(), "step": pa.uint64(),
              "request": _D, "attempt": pa.uint32(), "chunk_index": pa.int32(),
              "transfer_start_ns": pa.uint64(), "how": _D, "candidates": pa.uint32(), "share": pa.float64()}
_HOW_DICT = pa.array(HOW, pa.string())


class AttrColumns:
    """The attribution columns, built as one Arrow chunk per add()."""

    def __init__(self, steps: Cols, ch: Cols):
        self.steps, self.ch = steps, ch
        self.cols: dict[str, list] = {k: [] for k in ATTR_TYPES}

    def add(self, source, ts, start, pid, tid, nbytes, step_rows, req, cidx, tstart, how, cand, share) -> None:
        """Rows of one source.  step_rows / cidx: step and chunk rows (-1: none); req: a list of
        request ids, or (codes, distinct ids) for a dictionary column; tstart 0: no transfer."""
        k = len(ts)
        if not k:
            return
        att, steps, ch, u32 = self.cols, self.steps, self.ch, pa.uint32()
        att["source"].append(pa.DictionaryArray.from_arrays(pa.array(np.zeros(k, np.int32)), pa.array([source])))
        att["ts_ns"].append(pa.array(ts, pa.uint64()))
        att["start_ns"].append(pa.array(start, pa.uint64()))
        att["pid"].append(pa.array(pid, u32))
        att["tid"].append(pa.array(tid, u32))
        att["bytes"].append(pa.array(nbytes, pa.uint64()))
        ok = step_rows >= 0
        sr = np.maximum(step_rows, 0)
        att["engine_pid"].append(pa.array(np.where(ok, steps["pid"][sr] if steps.n else 0, 0), u32))
        att["step"].append(pa.array(np.where(ok, steps["step"][sr] if steps.n else 0, 0), pa.uint64(), mask=~ok))
        if isinstance(req, tuple):
            att["request"].append(pa.DictionaryArray.from_arrays(pa.array(req[0], pa.int32()), pa.array(req[1], pa.string())))
        else:
            att["request"].append(pa.array(req, pa.string()).dictionary_encode())
        okc = cidx >= 0
        ci = np.maximum(cidx, 0)
        att["attempt"].append(pa.array(np.where(okc, ch["attempt"][ci] if ch.n else 0, 0), u32, mask=~okc))
        att["chunk_index"].append(pa.array(np.where(okc, ch["chunk_index"][ci] if ch.n else 0, 0), pa.int32(), mask=~okc))
        att["transfer_start_ns"].append(pa.array(tstart, pa.uint64(), mask=tstart == 0))
        att["how"].append(pa.DictionaryArray.from_arrays(pa.array(np.asarray(how, np.int32)), _HOW_DICT))
        att["candidates"].append(pa.array(cand, u32))
        att["share"].append(pa.array(share, pa.float64()))

    def table(self) -> pa.Table:
        return pa.table({k: pa.chunked_array(v, ATTR_TYPES[k]) if v else pa.chunked_array([], ATTR_TYPES[k])
                         for k, v in self.cols.items()})


def attributions(ctx: Context, chunks: Chunks, transfers: Transfers, kio: dict[str, KernelIO], ev: Evictions,
                 pr: Preemptions, nvme: Nvme, ov: Overlaps) -> pa.Table:
    out = AttrColumns(ctx.steps, chunks.ch)
    add_kernel_io(out, kio, transfers)
    add_transfers(out, transfers)
    add_evictions(out, ev)
    add_preemptions(out, pr)
    add_nvme_threads(out, nvme, transfers)
    add_overlaps(out, ov)
    return out.table()


def add_kernel_io(out: AttrColumns, kio: dict[str, KernelIO], transfers: Transfers) -> None:
    """Final storage I/O rows: thread_time (with their transfer's request, chunk, start), shared or none."""
    tr = transfers.tr
    tr_requests = np.concatenate([tr["request"], np.array([""], dtype=object)]) if tr.n else np.array([""], dtype=object)
    for name, k in kio.items():
        x = k.x
        sel = np.flatnonzero(k.storage & k.final)
        trn = k.transfer[sel]
        okt = trn >= 0
        tsel = np.maximum(trn, 0)
        codes = np.where(okt, trn, tr.n).astype(np.int32)
        cidx = np.where(okt, transfers.chunk[tsel], -1) if tr.n else np.full(len(sel), -1)
        tstart = np.where(okt, tr["t_start_ns"][tsel], 0).astype(np.uint64) if tr.n else np.zeros(len(sel), np.uint64)
        out.add(name, x["ts_ns"][sel], k.t[sel], x["pid"][sel], x["tid"][sel], x["bytes"][sel], k.step[sel],
                (codes, tr_requests), cidx, tstart, k.how[sel], k.cand[sel], np.ones(len(sel)))


def add_transfers(out: AttrColumns, transfers: Transfers) -> None:
    tr = transfers.tr
    for d, name in (("load", "kv_load"), ("store", "kv_store")):
        sel = np.flatnonzero((tr["dir"] == d) & transfers.final)
        out.add(name, tr["t_end_ns"][sel], tr["t_start_ns"][sel], tr["pid"][sel], tr["tid"][sel], tr["nbytes"][sel],
                transfers.step[sel], tr["request"][sel].tolist(), transfers.chunk[sel], np.zeros(len(sel), np.uint64),
                transfers.how[sel], transfers.cand[sel], np.ones(len(sel)))


def add_evictions(out: AttrColumns, ev: Evictions) -> None:
    x, sel = ev.ev, np.flatnonzero(ev.final)
    out.add("evict", x["t_ns"][sel], x["t_ns"][sel], x["pid"][sel], np.zeros(len(sel), np.uint32),
            np.zeros(len(sel), np.uint64), ev.step[sel], x["request"][sel].tolist(), ev.chunk[sel],
            np.zeros(len(sel), np.uint64), np.where(x["request"][sel] != "", EXACT, SHARED).astype(int),
            (ev.step[sel] >= 0).astype(np.int32), np.ones(len(sel)))


def add_preemptions(out: AttrColumns, pr: Preemptions) -> None:
    x, sel = pr.pr, np.flatnonzero(pr.final)
    out.add("preempt", x["t_ns"][sel], x["t_ns"][sel], x["pid"][sel], np.zeros(len(sel), np.uint32),
            np.zeros(len(sel), np.uint64), pr.step[sel], x["request"][sel].tolist(), pr.chunk[sel],
            np.zeros(len(sel), np.uint64), np.full(len(sel), EXACT), (pr.step[sel] >= 0).astype(np.int32),
            np.ones(len(sel)))


def add_nvme_threads(out: AttrColumns, nvme: Nvme, transfers: Transfers) -> None:
    """NVMe commands issued by a final transfer's thread while it ran: thread_time to it."""
    nv, tr = nvme.nv, transfers.tr
    if nv is None or not tr.n:
        return
    sel = np.flatnonzero((nvme.transfer >= 0) & transfers.final[np.maximum(nvme.transfer, 0)])
    trn = nvme.transfer[sel]
    out.add("nvme_cmd", nv["ts_ns"][sel], nv["setup_ns"][sel], nv["pid"][sel], nv["tid"][sel], nv["bytes"][sel],
            transfers.step[trn], tr["request"][trn].tolist(), transfers.chunk[trn], tr["t_start_ns"][trn].astype(np.uint64),
            np.full(len(sel), THREAD), np.ones(len(sel), np.int32), np.ones(len(sel)))


def add_overlaps(out: AttrColumns, ov: Overlaps) -> None:
    """NVMe/NIC rows' time overlaps with final steps, per table (sorted by name)."""
    if not ov.attr:
        return
    o = list(zip(*ov.attr))
    for name in sorted(set(o[0])):
        sel = [i for i, v in enumerate(o[0]) if v == name]
        srows = np.array([o[3][i] for i in sel], np.int64)
        out.add(name, np.array([o[1][i] for i in sel], np.uint64), np.array([o[2][i] for i in sel], np.uint64),
                np.zeros(len(sel), np.uint32), np.zeros(len(sel), np.uint32), np.zeros(len(sel), np.uint64), srows,
                [""] * len(sel), np.full(len(sel), -1), np.zeros(len(sel), np.uint64), np.full(len(sel), OVERLAP),
                np.ones(len(sel), np.int32), np.array([o[4][i] for i in sel], np.float64))
