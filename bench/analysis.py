"""Benchmark of the offline analysis: `kvtrace analyze` on a synthetic dataset of 10M events
(DuckDB), and the `whatif` replay rate in block lookups per second.

    .venv/bin/python bench/analysis.py [--short] [--json FILE] [--repeat N] [--baseline TREE]

The dataset mimics a long run: requests in groups sharing a prefix, chunked prefill, evictions
of earlier prompts' blocks, per-request KV loads, and the kernel's block and file I/O (most
of the events).  It is generated with numpy and written as the agent writes (one Parquet file
per table, kvtrace metadata).  What is timed is the command a user runs, `python -m kvtrace
analyze DIR` in a new process (start-up, imports, the analysis and the terminal report; output
to /dev/null), after one untimed `--json` run that warms the OS cache and gives the check
figures; wall time and the process' CPU time (user + system) of each run, and the load average.
The whatif replay runs in a new process too.  With --baseline TREE (a kvtrace source tree, e.g.
`git archive` of an earlier commit) the same runs are made with that tree's kvtrace,
interleaved with this one's, so before and after are measured side by side on the same data.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtrace.capture.usermark import schema_for  # noqa: E402
from kvtrace.dataset import schema  # noqa: E402

MS = 1_000_000
BS = 32
REPO = Path(__file__).resolve().parents[1]
EVENTS = 10_000_000      # full mode: hook records + kernel I/O rows


def _write(root: Path, table: str, cols: dict, run="bench") -> int:
    sch = schema_for(table) or schema.TABLES[table]
    n = len(next(iter(cols.values())))
    arrays = []
    for f in sch:
        if f.name in cols:
            arrays.append(pa.array(cols[f.name], type=f.type))
        elif pa.types.is_string(f.type) or pa.types.is_dictionary(f.type):
            arrays.append(pa.array([""] * n, type=pa.string()).cast(f.type))
        else:
            arrays.append(pa.array(np.zeros(n, dtype=np.int64)).cast(f.type))
    t = schema.with_run(pa.Table.from_arrays(arrays, schema=pa.schema([pa.field(f.name, a.type) for f, a in zip(sch, arrays)])), run)
    t = t.replace_schema_metadata({schema.META_KEY: json.dumps({"schema_version": schema.SCHEMA_VERSION, "kvtrace_version": "bench",
                                                                "run": run, "table": table}).encode()})
    path = root / table / "host=bench" / "date=2026-11-30" / f"{run}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, path, compression="zstd")
    return n


def synth(root: Path, requests: int, events: int, seed: int = 1) -> dict:
    """Requests of 1,000-2,000 tokens in groups of 4 sharing a 640-token prefix, 256-token chunks,
    one step per chunk, an eviction of 5 blocks per request, a KV load per 8th request, plus
    kernel rows (block and file reads) up to `events` rows in all."""
    rng = np.random.default_rng(seed)
    n = requests
    plen = rng.integers(1000, 2001, n)
    ids = np.array([f"cmpl-r{i}-0-0000" for i in range(n)], dtype=object)
    nchunks = -(-plen // 256)
    # steps: one per chunk of request i, requests back to back (a run's worth of steps)
    total_chunks = int(nchunks.sum())
    step_no = np.arange(1, total_chunks + 1)
    t_start = step_no * 10 * MS
    req_of = np.repeat(np.arange(n), nchunks)
    first = np.concatenate([[0], np.cumsum(nchunks)[:-1]])
    idx = np.arange(total_chunks) - first[req_of]
    hit = np.where(np.arange(n) % 4 == 0, 0, 640)
    start = hit[req_of] + idx * 256
    length = np.minimum(256, plen[req_of] - start)
    keep = length > 0
    ev = {}
    ev["step"] = _write(root, "step", {"step": step_no, "t_start_ns": t_start, "t_sched_end_ns": t_start + MS // 2,
                                       "t_end_ns": t_start + 8 * MS, "total_tokens": np.full(total_chunks, 256),
                                       "prefill_tokens": np.full(total_chunks, 256), "pid": np.full(total_chunks, 100)})
    ev["chunk"] = _write(root, "chunk", {"step": step_no[keep], "request": ids[req_of[keep]], "attempt": np.zeros(keep.sum(), int),
                                         "chunk_index": idx[keep], "start": start[keep], "length": length[keep],
                                         "prompt_len": plen[req_of[keep]], "prefill_len": plen[req_of[keep]],
                                         "last": (start + length >= plen[req_of])[keep].astype(int), "resumed": np.zeros(keep.sum(), int),
                                         "pid": np.full(keep.sum(), 100)})
    ev["admit"] = _write(root, "admit", {"step": step_no[first], "request": ids, "attempt": np.zeros(n, int), "prompt_len": plen,
                                         "prefill_len": plen, "cached_local": hit, "cached_external": np.zeros(n, int), "start": hit,
                                         "hit_blocks": hit // BS, "pid": np.full(n, 100)})
    ev["arrive"] = _write(root, "arrive", {"step": step_no[first], "t_ns": t_start[first] - 3 * MS, "request": ids, "pid": np.full(n, 100)})
    # prompt hashes: groups of 4 share their first 20 blocks
    group = np.arange(n) // 4
    nb = plen // BS
    hashes = []
    for i in range(n):
        h = [(1 << 63) | (int(group[i]) << 20) | j for j in range(20)] + [(1 << 62) | (i << 20) | j for j in range(20, int(nb[i]))]
        hashes.append(h)
    ev["prompt_blocks"] = _write(root, "prompt_blocks", {"step": step_no[first], "request": ids, "block_size": np.full(n, BS),
                                                         "prompt_len": plen, "max_output": np.full(n, 8), "num_blocks": nb,
                                                         "first": np.zeros(n, int), "hashes": hashes, "pid": np.full(n, 100)})
    # each request (after the first 8) evicts 5 blocks of the request 8 before it: the tail of its private part
    src = np.arange(n) - 8
    ok = src >= 0
    ev_req = np.repeat(np.arange(n)[ok], 5)
    ev_src = np.repeat(src[ok], 5)
    ev_j = nb[ev_src] - 1 - np.tile(np.arange(5), ok.sum())
    ev_hash = [(1 << 62) | (int(s) << 20) | int(j) for s, j in zip(ev_src, ev_j)]
    ev["evict"] = _write(root, "evict", {"step": step_no[first[ev_req]], "t_ns": t_start[first[ev_req]] + MS // 4,
                                         "block_hash": ev_hash, "request": ids[ev_req], "pid": np.full(len(ev_req), 100)})
    lr = np.arange(0, n, 8)
    ev["kv_load"] = _write(root, "kv_load", {"t_start_ns": t_start[first[lr]] + MS, "t_end_ns": t_start[first[lr]] + 2 * MS,
                                             "blocks": np.full(len(lr), 20), "nbytes": np.full(len(lr), 20 * 65536),
                                             "request": ids[lr], "source": np.array(["kvtrace-file"] * len(lr), dtype=object),
                                             "pid": np.full(len(lr), 101)})
    io_events = max(events - sum(ev.values()), 0)
    half = io_events // 2
    ts = np.sort(rng.integers(MS, int(t_start[-1]), half))
    lat = rng.lognormal(11.5, 0.6, half).astype(np.int64)
    ev["block_io"] = _write(root, "block_io", {"ts_ns": ts, "start_ns": ts - lat, "issue_ns": ts - lat + 2000, "pid": np.full(half, 101),
                                               "disk": np.array(["nvme0n1", "nvme1n1"], dtype=object)[rng.integers(0, 2, half)],
                                               "bytes": np.full(half, 65536), "op": np.array(["R"] * half, dtype=object),
                                               "latency_ns": lat, "queue_ns": np.full(half, 2000), "device_ns": lat - 2000})
    ts2 = np.sort(rng.integers(MS, int(t_start[-1]), io_events - half))
    lat2 = rng.lognormal(10.5, 0.7, io_events - half).astype(np.int64)
    m = io_events - half
    ev["file_io"] = _write(root, "file_io", {"ts_ns": ts2, "start_ns": ts2 - lat2, "pid": np.full(m, 101), "tid": np.full(m, 102),
                                             "syscall": np.array(["preadv2"] * m, dtype=object),
                                             "path": np.array(["/var/tmp/kvblocks/a", "/var/tmp/kvblocks/b"], dtype=object)[rng.integers(0, 2, m)],
                                             "bytes": np.full(m, 65536), "ret": np.full(m, 65536), "latency_ns": lat2})
    return ev


def _run(tree: Path, args: list, out=subprocess.DEVNULL) -> tuple[float, float, str]:
    """One command in a new process with `tree`'s kvtrace: wall s, CPU s (user + system), stdout."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args], env=env, cwd=tree, stdout=out, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"{args} with {tree} failed: {p.stderr[-1000:]}")
    return dt, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), p.stdout or ""


def _summary(runs: list[dict], key: str) -> dict:
    v = [r[key] for r in runs]
    return {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}


def bench_analyze(short: bool, trees: dict[str, Path], repeat: int) -> dict:
    requests, events = (4_000, 1_000_000) if short else (40_000, EVENTS)
    root = Path(tempfile.mkdtemp(prefix="kvtrace-bench-an-"))
    try:
        t0 = time.perf_counter()
        ev = synth(root, requests, events)
        gen = time.perf_counter() - t0
        hashes = sum(len(x) for x in pq.read_table(root / "prompt_blocks", columns=["hashes"])["hashes"].to_pylist())
        out = {}
        for name, tree in trees.items():  # untimed: OS cache warm, and the figures to check
            rep = json.loads(_run(tree, ["-m", "kvtrace", "analyze", str(root), "--json"], out=subprocess.PIPE)[2])
            out[name] = {"check": {"hit_rate": rep["reuse"]["hit_rate"], "evictions": rep["chunking"]["evictions"]["evictions"],
                                   "rereferenced": rep["chunking"]["evictions"]["rereferenced"],
                                   "chunks": rep["timing"]["chunks"]}, "runs": []}
        for _ in range(repeat):
            for name, tree in trees.items():
                la = os.getloadavg()[0]
                dt, cpu, _ = _run(tree, ["-m", "kvtrace", "analyze", str(root)])
                out[name]["runs"].append({"wall_s": round(dt, 3), "cpu_s": round(cpu, 3), "load_avg_1m": la})
        n = sum(ev.values())
        for name, o in out.items():
            w, c = _summary(o["runs"], "wall_s"), _summary(o["runs"], "cpu_s")
            o.update({"events": n, "rows": ev, "prompt_block_hashes": hashes, "generate_s": round(gen, 2),
                      "analyze_s": w["median"], "analyze_best_s": w["min"], "analyze_cpu_s": c["median"], "wall_s": w, "cpu_s": c,
                      "events_per_s": round(n / w["median"]), "load_avg_1m": statistics.median(r["load_avg_1m"] for r in o["runs"])})
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


WHATIF = """
import json, sys, time
from kvtrace.analysis.whatif import Replay, Req, Workload
n, blocks = {n}, {blocks}
reqs = []
for i in range(n):
    g = i % 10
    chain = [(1 << 63) | (g << 24) | j for j in range(blocks - 10)] + [(1 << 62) | (i << 24) | j for j in range(10)]
    reqs.append(Req(f"r{{i}}", i * 1_000_000_000, blocks * 32, 1, chain))
kw = {{"kind": "vllm"}} if "kind" in Workload.__dataclass_fields__ else {{}}   # a --baseline tree before server kinds
wl = Workload(reqs, 32, {{}}, (5e6, 1e3, 1e5), [], **kw)
out = []
for cache in (blocks * 20, blocks * 60):
    t0, c0 = time.perf_counter(), time.process_time()
    s = Replay(wl, 8192, 32, cache).run()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    out.append({{"cache_blocks": cache, "lookups": s["lookups"], "replay_s": round(dt, 3), "replay_cpu_s": round(dc, 3),
                "lookups_per_s": round(s["lookups"] / dt), "lookups_per_cpu_s": round(s["lookups"] / dc),
                "hit_rate": round(s["hit_rate"], 4), "evictions": s["evictions"]}})
print(json.dumps(out))
"""


def bench_whatif(short: bool, trees: dict[str, Path], repeat: int) -> dict:
    """Replay of groups of requests sharing long prefixes: lookups dominate."""
    n, blocks = (400, 500) if short else (2_000, 1_000)
    out = {name: {"requests": n, "blocks_per_prompt": blocks, "runs": []} for name in trees}
    for _ in range(repeat):
        for name, tree in trees.items():
            la = os.getloadavg()[0]
            runs = json.loads(_run(tree, ["-c", WHATIF.format(n=n, blocks=blocks)], out=subprocess.PIPE)[2])
            out[name]["runs"] += [{**r, "load_avg_1m": la} for r in runs]
    for o in out.values():
        r = o["runs"]
        o.update({"lookups_per_s": round(statistics.median(x["lookups_per_s"] for x in r)),
                  "lookups_per_s_best": max(x["lookups_per_s"] for x in r),
                  "lookups_per_cpu_s": round(statistics.median(x["lookups_per_cpu_s"] for x in r)),
                  "load_avg_1m": statistics.median(x["load_avg_1m"] for x in r)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per tree (default 3, 1 with --short)")
    ap.add_argument("--baseline", default=None, help="another kvtrace source tree, measured side by side")
    a = ap.parse_args()
    repeat = a.repeat or (1 if a.short else 3)
    trees = {"current": REPO}
    if a.baseline:
        trees["baseline"] = Path(a.baseline).resolve()
    an, wi = bench_analyze(a.short, trees, repeat), bench_whatif(a.short, trees, repeat)
    res = {"analyze": an.pop("current"), "whatif": wi.pop("current"), "cores": os.cpu_count()}
    if a.baseline:
        res["baseline"] = {"tree": str(trees["baseline"]), "analyze": an["baseline"], "whatif": wi["baseline"]}
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
