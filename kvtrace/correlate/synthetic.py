"""Recorded-table builders for tests and benchmarks: rows in the exact column types the capture
writes (hook records as decoded by kvtrace.capture.usermark, kernel tables as kvtrace.dataset.schema).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pyarrow as pa

from kvtrace.correlate.inputs import HOOK
from kvtrace.dataset import schema
from kvtrace.capture.usermark import schema_for

_TYPES = {"u1": pa.uint8(), "u4": pa.uint32(), "u8": pa.uint64(), "i4": pa.int32(), "i8": pa.int64(), "O": pa.string()}


def hook_schema(name: str) -> pa.Schema:
    try:

        s = schema_for(name)
        if s is not None:
            return s
    except Exception:
        pass
    fields = [(k, _TYPES[v]) for k, v in HOOK[name].items() if k not in ("pid", "tid")]
    return pa.schema(fields + [("mark_ns", pa.uint64()), ("pid", pa.uint32()), ("tid", pa.uint32())])


def table(name: str, rows: list[dict]) -> pa.Table:
    """A table of ``name`` from row dicts; missing columns are zero / empty."""
    sch = schema.TABLES.get(name) if name in schema.TABLES else hook_schema(name)
    cols = {}
    for f in sch:
        vals = [r.get(f.name) for r in rows]
        text = pa.types.is_string(f.type) or pa.types.is_dictionary(f.type)
        default = "" if text else False if pa.types.is_boolean(f.type) else [] if pa.types.is_list(f.type) else 0
        vals = [default if v is None else v for v in vals]
        cols[f.name] = pa.array(vals, pa.string()).cast(f.type) if text else pa.array(vals, f.type)
    return pa.table(cols, schema=sch)


_BYTES_PER_BLOCK = 65536
_ROWS = ("step", "chunk", "admit", "evict", "preempt", "kv_load", "arrive", "finish", "file_io", "block_io")


def _requests(rnd: random.Random, n_requests: int, block: int, t: int) -> list[dict]:
    """The requests in arrival order; draws three to five numbers each from ``rnd``."""
    pending = []
    for i in range(n_requests):
        prompt = rnd.randrange(200, 1500)
        ext = rnd.choice([0, 0, block * rnd.randrange(1, 6)])
        loc = rnd.choice([0, block * rnd.randrange(1, 4)])
        pending.append({"id": f"cmpl-r{i}-0-{i:08x}", "prompt": prompt, "ext": min(ext, prompt - 1 - loc) // block * block,
                        "loc": loc, "attempt": 0, "done": loc, "arrival": t + i * 1000, "n": i})
    return pending


@dataclass
class _Sim:
    """The scheduler of :func:`workload`. The methods draw from ``rnd`` in a fixed order (step length;
    per admission the traceparent; per chunk the evictions; the preemption; the finishes), which keeps
    the tables of a seed the same across versions: do not reorder the draws."""
    rnd: random.Random
    engine: int
    worker: int
    block: int
    budget: int
    reads_per_block: int
    shared_io_per_step: int
    traceparent_every: int
    rows: dict[str, list] = field(default_factory=lambda: {k: [] for k in _ROWS})

    def step(self, step: int, t: int, pending: list, running: list, finished_ids: list) -> tuple[int, list]:
        """One scheduler step starting at ``t``; returns the next step's start and the requests
        finishing in it (reported at the next step)."""
        ts0 = t
        ts1 = t + 20_000
        te = ts1 + self.rnd.randrange(300_000, 3_000_000)
        admitted: list = []
        lt, n_chunks, prefill_tokens = self._prefill(step, ts0, ts1 + 1000, pending, running, admitted)
        te = max(te, lt + 1000)
        self._shared_io(ts1)
        decode = [r for r in running if r["done"] >= r["prompt"]]
        self._maybe_preempt(step, ts0, decode, running, pending)
        for r in finished_ids:
            self.rows["finish"].append(dict(step=step, t_ns=ts0 + 10, request=r, pid=self.engine))
        finished_ids = []
        for r in list(running):
            if r["done"] >= r["prompt"] and r is not None and r not in admitted and self.rnd.random() < 0.5:
                running.remove(r)
                finished_ids.append(r["id"])
        self.rows["step"].append(dict(step=step, t_start_ns=ts0, t_sched_end_ns=ts1, t_end_ns=te,
                                      num_reqs=len(running), total_tokens=prefill_tokens + len(decode),
                                      prefill_reqs=n_chunks, prefill_tokens=prefill_tokens, decode_reqs=len(decode),
                                      decode_tokens=len(decode), pid=self.engine, tid=self.engine))
        return max(te, lt) + 50_000, finished_ids

    def _prefill(self, step: int, ts0: int, lt: int, pending: list, running: list,
                 admitted: list) -> tuple[int, int, int]:
        """Chunked prefill within the token budget: the running requests first, then admissions
        (at most 4 running). Returns the worker thread's time after the loads, chunks and tokens."""
        budget_left = self.budget
        n_chunks = prefill_tokens = 0
        queue = [r for r in running]
        while True:
            if queue:
                r = queue.pop(0)
            elif pending and len(running) < 4 and budget_left > 0:
                r = pending.pop(0)
                self._admit(step, r, running, admitted)
            else:
                break
            if budget_left <= 0:
                continue
            n = min(budget_left, r["prompt"] - r["done"])
            if n <= 0:
                continue
            lt = self._chunk(step, ts0, r, n, lt, r in admitted)
            budget_left -= n
            n_chunks += 1
            prefill_tokens += n
        return lt, n_chunks, prefill_tokens

    def _admit(self, step: int, r: dict, running: list, admitted: list) -> None:
        r["done"] = r["loc"] + r["ext"]
        running.append(r)
        admitted.append(r)
        self.rows["admit"].append(dict(step=step, request=r["id"], attempt=r["attempt"], prompt_len=r["prompt"],
                                       prefill_len=r["prompt"], cached_local=r["loc"], cached_external=r["ext"],
                                       start=r["done"], hit_blocks=r["loc"] // self.block, pid=self.engine,
                                       tid=self.engine, resumed=1 if r["attempt"] else 0))
        if r["attempt"] == 0:
            tp = (f"00-{self.rnd.getrandbits(128):032x}-{self.rnd.getrandbits(64):016x}-01"
                  if r["n"] % self.traceparent_every == 0 else "")
            self.rows["arrive"].append(dict(step=step, t_ns=r["arrival"], request=r["id"], traceparent=tp,
                                            pid=self.engine))

    def _chunk(self, step: int, ts0: int, r: dict, n: int, lt: int, admitted: bool) -> int:
        """A prefill chunk of ``n`` tokens of ``r``, the load of its external hits when just admitted,
        and the evictions its allocation causes. Returns the worker thread's time after the load."""
        idx = r.setdefault("idx", 0)
        self.rows["chunk"].append(dict(step=step, request=r["id"], attempt=r["attempt"], chunk_index=idx,
                                       start=r["done"], length=n, prompt_len=r["prompt"], prefill_len=r["prompt"],
                                       last=1 if r["done"] + n >= r["prompt"] else 0,
                                       resumed=1 if r["attempt"] else 0, pid=self.engine, tid=self.engine))
        if admitted and r["ext"]:
            lt = self._load(r, lt)
        # evictions caused by this chunk's allocation
        for e in range(self.rnd.choice([0, 0, 1, 3])):
            self.rows["evict"].append(dict(step=step, t_ns=ts0 + 100 + e, block_hash=self.rnd.getrandbits(64),
                                           group=0, block_id=self.rnd.randrange(1, 122), medium="GPU",
                                           request=r["id"], pid=self.engine))
        r["done"] += n
        r["idx"] = idx + 1
        return lt

    def _load(self, r: dict, lt: int) -> int:
        """The connector load of ``r``'s external hits, block by block on the worker thread from ``lt``."""
        nb = r["ext"] // self.block
        per_read = _BYTES_PER_BLOCK // self.reads_per_block
        tid = self.worker + 1
        l0 = lt
        for b in range(nb):
            for _ in range(self.reads_per_block):
                s = lt + 100
                lt = s + 4000
                self.rows["file_io"].append(dict(ts_ns=lt, start_ns=s, pid=self.worker, tid=tid, syscall="preadv2",
                                                 fd=7, path=f"/var/kv/{r['id']}-{b}", offset=0, bytes=per_read,
                                                 ret=per_read, latency_ns=4000))
                self.rows["block_io"].append(dict(ts_ns=lt - 500, start_ns=s + 200, pid=self.worker, tid=tid,
                                                  disk="nvme0n1", bytes=per_read, op="R", latency_ns=3300,
                                                  queue_ns=300, device_ns=3000))
        self.rows["kv_load"].append(dict(t_start_ns=l0, t_end_ns=lt + 100, t_issue_end_ns=lt + 100, blocks=nb,
                                         nbytes=nb * _BYTES_PER_BLOCK, request=r["id"], source="kvtrace-file",
                                         pid=self.worker, tid=tid))
        return lt + 200

    def _shared_io(self, ts1: int) -> None:
        """Unrelated reads on another worker thread, every step."""
        for k in range(self.shared_io_per_step):
            s = ts1 + 500 + k * 700
            self.rows["file_io"].append(dict(ts_ns=s + 300, start_ns=s, pid=self.worker, tid=self.worker + 2,
                                             syscall="read", fd=9, path="/var/lib/other", bytes=4096, ret=4096,
                                             latency_ns=300))

    def _maybe_preempt(self, step: int, ts0: int, decode: list, running: list, pending: list) -> None:
        """Now and then preempt the newest decoding request; it is re-admitted later."""
        if len(decode) >= 2 and self.rnd.random() < 0.05:
            v = decode[-1]
            running.remove(v)
            self.rows["preempt"].append(dict(step=step, t_ns=ts0 + 50, request=v["id"], computed_before=v["done"],
                                             num_tokens=v["done"] + 2, num_preemptions=v["attempt"] + 1,
                                             for_request=running[0]["id"] if running else "", pid=self.engine))
            v["attempt"] += 1
            v["loc"] = (v["prompt"] // 2) // self.block * self.block
            v["ext"] = 0
            v["idx"] = 0
            pending.insert(0, v)


def workload(n_requests: int = 1000, seed: int = 1, engine: int = 100, worker: int = 200, block: int = 32,
             budget: int = 256, reads_per_block: int = 1, shared_io_per_step: int = 2, t0: int = 10**12,
             traceparent_every: int = 3) -> dict[str, pa.Table]:
    """A recorded run: requests with shared prefixes, chunked prefill at ``budget`` tokens a step,
    connector loads of external hits read block by block on the worker thread, shared I/O on
    another thread, evictions, preemptions with re-admission, arrive/finish records."""
    rnd = random.Random(seed)
    sim = _Sim(rnd, engine=engine, worker=worker, block=block, budget=budget, reads_per_block=reads_per_block,
               shared_io_per_step=shared_io_per_step, traceparent_every=traceparent_every)
    pending = _requests(rnd, n_requests, block, t0)
    running: list = []
    finished_ids: list = []
    t = t0
    step = 0
    while pending or running:
        step += 1
        t, finished_ids = sim.step(step, t, pending, running, finished_ids)
    for r in finished_ids:
        sim.rows["finish"].append(dict(step=step + 1, t_ns=t, request=r, pid=engine))
    return {k: table(k, v) for k, v in sim.rows.items()}
