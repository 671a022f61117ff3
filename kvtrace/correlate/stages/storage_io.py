"""Kernel storage I/O (block_io, storage file_io, io_uring READ*/WRITE*).  Issued on the thread of
a KV transfer while it runs: thread_time to that transfer (a transfer naming its request wins
over a per-step one), and through it to its step, request and chunk.  Other storage I/O of the
engine's processes: shared by the step holding its start.  Outside every step: none.  Rows
that are not storage (sockets, pipes, /proc, SEND/RECV) get no step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.correlate.inputs import Cols
from kvtrace.correlate.stages.context import NONE, SHARED, THREAD, Context, engine_map, thread_match
from kvtrace.correlate.stages.transfers import Transfers

KERNEL_TABLES = (("block_io", "start_ns"), ("file_io", "start_ns"), ("io_uring", "submit_ns"))  # table, start column
STEP_IO = ("file_read_bytes", "file_write_bytes", "block_read_bytes", "block_write_bytes", "io_uring_bytes",
           "shared_file_bytes", "shared_block_bytes")


@dataclass
class KernelIO:
    """One kernel table's rows, placed."""

    x: Cols
    t: np.ndarray         # start (the end when the start was not recorded)
    storage: np.ndarray   # storage I/O (only those are placed)
    transfer: np.ndarray  # transfer row (thread_time), -1 if none
    step: np.ndarray      # step row, -1 if none or not storage
    how: np.ndarray       # HOW code
    cand: np.ndarray      # how many step windows held its start
    final: np.ndarray     # finalised by this pass
    engine: np.ndarray    # the engine its process belongs to

    def decided(self, horizon) -> np.ndarray:
        """Rows the pass is done with: final ones, and non-storage ones before the horizon."""
        return self.final | ~self.storage & (self.t < horizon)


def storage_io(ctx: Context, transfers: Transfers) -> dict[str, KernelIO]:
    return {name: kernel_io(ctx, transfers, name, t_start) for name, t_start in KERNEL_TABLES}


def kernel_io(ctx: Context, transfers: Transfers, name: str, t_start: str) -> KernelIO:
    x = ctx.cols[name]
    tr = transfers.tr
    storage = np.ones(x.n, bool) if name == "block_io" else x["storage"]
    t = np.where(x[t_start] > 0, x[t_start], x["ts_ns"])
    # thread + time: inside a transfer of the same thread (named transfers first)
    transfer = thread_match(x["pid"], x["tid"], t, storage, tr, transfers.named)
    engine = engine_map(x["pid"], ctx.engines, ctx.cols["processes"])
    step, cand = ctx.index.locate(engine, t)
    via = transfer >= 0
    step = np.where(via, transfers.step[np.maximum(transfer, 0)] if tr.n else -1, step)
    how = np.where(via, THREAD, np.where((step >= 0) & storage, SHARED, NONE))
    step = np.where(storage, step, -1)
    return KernelIO(x, t, storage, transfer, step, how, cand, ctx.final_of(step, t), engine)


def step_io_bytes(n_steps: int, kio: dict[str, KernelIO]) -> dict[str, np.ndarray]:
    """Per step row: the bytes of its storage I/O by kind (STEP_IO), shared ones apart."""
    io_sum = {k: np.zeros(n_steps, np.int64) for k in STEP_IO}
    for name, k in kio.items():
        x, st = k.x, k.step
        m = st >= 0
        b = x["bytes"].astype(np.int64)
        if name == "block_io":
            np.add.at(io_sum["block_read_bytes"], st[m & x["is_read"]], b[m & x["is_read"]])
            np.add.at(io_sum["block_write_bytes"], st[m & x["is_write"]], b[m & x["is_write"]])
            sh = m & (k.how == SHARED)
            np.add.at(io_sum["shared_block_bytes"], st[sh], b[sh])
        else:
            if name == "file_io":
                np.add.at(io_sum["file_read_bytes"], st[m & x["is_read"]], b[m & x["is_read"]])
                np.add.at(io_sum["file_write_bytes"], st[m & ~x["is_read"]], b[m & ~x["is_read"]])
            else:
                np.add.at(io_sum["io_uring_bytes"], st[m], b[m])
            sh = m & (k.how == SHARED)
            np.add.at(io_sum["shared_file_bytes"], st[sh], b[sh])
    return io_sum
