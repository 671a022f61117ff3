"""Recorded-table builders for tests and benchmarks: rows in the exact column types the capture
writes (hook records as decoded by kvtrace.capture.usermark, kernel tables as kvtrace.dataset.schema).
"""
from __future__ import annotations

import random

import pyarrow as pa

from kvtrace.correlate.inputs import HOOK
from kvtrace.dataset import schema

_TYPES = {"u1": pa.uint8(), "u4": pa.uint32(), "u8": pa.uint64(), "i4": pa.int32(), "i8": pa.int64(), "O": pa.string()}


def hook_schema(name: str) -> pa.Schema:
    try:
        from kvtrace.capture.usermark import schema_for

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


def workload(n_requests: int = 1000, seed: int = 1, engine: int = 100, worker: int = 200, block: int = 32,
             budget: int = 256, reads_per_block: int = 1, shared_io_per_step: int = 2, t0: int = 10**12,
             traceparent_every: int = 3) -> dict[str, pa.Table]:
    """A recorded run: requests with shared prefixes, chunked prefill at ``budget`` tokens a step,
    connector loads of external hits read block by block on the worker thread, shared I/O on
    another thread, evictions, preemptions with re-admission, arrive/finish records."""
    rnd = random.Random(seed)
    rows: dict[str, list] = {k: [] for k in ("step", "chunk", "admit", "evict", "preempt", "kv_load", "arrive",
                                             "finish", "file_io", "block_io")}
    t = t0
    step = 0
    pending = []
    for i in range(n_requests):
        prompt = rnd.randrange(200, 1500)
        ext = rnd.choice([0, 0, block * rnd.randrange(1, 6)])
        loc = rnd.choice([0, block * rnd.randrange(1, 4)])
        pending.append({"id": f"cmpl-r{i}-0-{i:08x}", "prompt": prompt, "ext": min(ext, prompt - 1 - loc) // block * block,
                        "loc": loc, "attempt": 0, "done": loc, "arrival": t + i * 1000, "n": i})
    running: list = []
    finished_ids: list = []
    bytes_per_block = 65536
    while pending or running:
        step += 1
        ts0 = t
        ts1 = t + 20_000
        te = ts1 + rnd.randrange(300_000, 3_000_000)
        admitted = []
        budget_left = budget
        n_chunks = prefill_tokens = 0
        lt = ts1 + 1000
        queue = [r for r in running]
        while True:
            if queue:
                r = queue.pop(0)
            elif pending and len(running) < 4 and budget_left > 0:
                r = pending.pop(0)
                r["done"] = r["loc"] + r["ext"]
                running.append(r)
                admitted.append(r)
                rows["admit"].append(dict(step=step, request=r["id"], attempt=r["attempt"], prompt_len=r["prompt"],
                                          prefill_len=r["prompt"], cached_local=r["loc"], cached_external=r["ext"],
                                          start=r["done"], hit_blocks=r["loc"] // block, pid=engine, tid=engine,
                                          resumed=1 if r["attempt"] else 0))
                if r["attempt"] == 0:
                    tp = (f"00-{rnd.getrandbits(128):032x}-{rnd.getrandbits(64):016x}-01"
                          if r["n"] % traceparent_every == 0 else "")
                    rows["arrive"].append(dict(step=step, t_ns=r["arrival"], request=r["id"], traceparent=tp, pid=engine))
            else:
                break
            if budget_left <= 0:
                continue
            n = min(budget_left, r["prompt"] - r["done"])
            if n <= 0:
                continue
            idx = r.setdefault("idx", 0)
            rows["chunk"].append(dict(step=step, request=r["id"], attempt=r["attempt"], chunk_index=idx, start=r["done"],
                                      length=n, prompt_len=r["prompt"], prefill_len=r["prompt"],
                                      last=1 if r["done"] + n >= r["prompt"] else 0, resumed=1 if r["attempt"] else 0,
                                      pid=engine, tid=engine))
            if r in admitted and r["ext"]:
                nb = r["ext"] // block
                l0 = lt
                for b in range(nb):
                    for k in range(reads_per_block):
                        s = lt + 100
                        lt = s + 4000
                        rows["file_io"].append(dict(ts_ns=lt, start_ns=s, pid=worker, tid=worker + 1, syscall="preadv2",
                                                    fd=7, path=f"/var/kv/{r['id']}-{b}", offset=0,
                                                    bytes=bytes_per_block // reads_per_block,
                                                    ret=bytes_per_block // reads_per_block, latency_ns=4000))
                        rows["block_io"].append(dict(ts_ns=lt - 500, start_ns=s + 200, pid=worker, tid=worker + 1,
                                                     disk="nvme0n1", bytes=bytes_per_block // reads_per_block, op="R",
                                                     latency_ns=3300, queue_ns=300, device_ns=3000))
                rows["kv_load"].append(dict(t_start_ns=l0, t_end_ns=lt + 100, t_issue_end_ns=lt + 100, blocks=nb,
                                            nbytes=nb * bytes_per_block, request=r["id"], source="kvtrace-file",
                                            pid=worker, tid=worker + 1))
                lt += 200
            # evictions caused by this chunk's allocation
            for e in range(rnd.choice([0, 0, 1, 3])):
                rows["evict"].append(dict(step=step, t_ns=ts0 + 100 + e, block_hash=rnd.getrandbits(64), group=0,
                                          block_id=rnd.randrange(1, 122), medium="GPU", request=r["id"], pid=engine))
            r["done"] += n
            r["idx"] = idx + 1
            budget_left -= n
            n_chunks += 1
            prefill_tokens += n
        te = max(te, lt + 1000)
        for k in range(shared_io_per_step):
            s = ts1 + 500 + k * 700
            rows["file_io"].append(dict(ts_ns=s + 300, start_ns=s, pid=worker, tid=worker + 2, syscall="read", fd=9,
                                        path="/var/lib/other", bytes=4096, ret=4096, latency_ns=300))
        decode = [r for r in running if r["done"] >= r["prompt"]]
        # preempt the newest decoding request now and then; it is re-admitted later
        if len(decode) >= 2 and rnd.random() < 0.05:
            v = decode[-1]
            running.remove(v)
            rows["preempt"].append(dict(step=step, t_ns=ts0 + 50, request=v["id"], computed_before=v["done"],
                                        num_tokens=v["done"] + 2, num_preemptions=v["attempt"] + 1,
                                        for_request=running[0]["id"] if running else "", pid=engine))
            v["attempt"] += 1
            v["loc"] = (v["prompt"] // 2) // block * block
            v["ext"] = 0
            v["idx"] = 0
            pending.insert(0, v)
        for r in finished_ids:
            rows["finish"].append(dict(step=step, t_ns=ts0 + 10, request=r, pid=engine))
        finished_ids = []
        for r in list(running):
            if r["done"] >= r["prompt"] and r is not None and r not in admitted and rnd.random() < 0.5:
                running.remove(r)
                finished_ids.append(r["id"])
        rows["step"].append(dict(step=step, t_start_ns=ts0, t_sched_end_ns=ts1, t_end_ns=te, num_reqs=len(running),
                                 total_tokens=prefill_tokens + len(decode), prefill_reqs=n_chunks,
                                 prefill_tokens=prefill_tokens, decode_reqs=len(decode), decode_tokens=len(decode),
                                 pid=engine, tid=engine))
        t = max(te, lt) + 50_000
    for r in finished_ids:
        rows["finish"].append(dict(step=step + 1, t_ns=t, request=r, pid=engine))
    return {k: table(k, v) for k, v in rows.items()}
