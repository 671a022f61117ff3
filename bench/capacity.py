"""Kernel event capacity and per-event cost on the traced process (needs root).

A pread loop on tmpfs produces one file_io event per call.  For each target rate (and
flat out) it runs the producer under `kvtrace attach` and reports events decoded per
second, events lost (the kernel's count of failed ring-buffer reserves), and the
producer's own call rate; the flat-out run is paired with an untraced run side by side,
giving the per-event cost on the traced process as a difference of per-call times.

    sudo .venv/bin/python bench/capacity.py [--short] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PY = sys.executable


def producer(path: str, seconds: float, rate: float = 0.0) -> list[str]:
    return [PY, "-m", "kvtrace.workloads", "pread-loop", "--path", path, "--chunk", "64", "--seconds", str(seconds), "--rate", str(rate)]


def untraced(path: str, seconds: float) -> dict:
    out = subprocess.run(producer(path, seconds), check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def traced(path: str, seconds: float, rate: float, ringbuf_pages: int = 1024, sampling: str = "off") -> dict:
    from kvtrace.dataset.reader import Dataset

    with tempfile.TemporaryDirectory() as d:
        res = os.path.join(d, "r.json")
        t0 = time.monotonic()
        p = subprocess.run(
            [PY, "-m", "kvtrace", "attach", "--quiet", "--sampling", sampling, "--probe", "fileio", "--no-writes", "--ringbuf-pages", str(ringbuf_pages),
             "--out", os.path.join(d, "ds"), "--", *producer(path, seconds, rate), "--result", res],
            capture_output=True, text=True, check=True,
        )
        wall = time.monotonic() - t0
        truth = json.load(open(res))
        ds = Dataset.open(os.path.join(d, "ds"))
        (run,) = ds.runs()
        io = ds.table("file_io")
        import pyarrow.compute as pc

        mine_rows = io.filter(pc.and_(pc.equal(io["path"].cast("string"), path), pc.equal(io["syscall"].cast("string"), "pread64")))
        mine = mine_rows.num_rows
        lost = run["lost_events"].get("file_io", 0)
        extra = {}
        if sampling != "off":
            # the in-kernel count of the producer's pread64 calls (it also holds the interpreter's
            # own few start-up preads), and what the sampled raw rows stand for
            fa = ds.table("file_agg")
            fa = fa.filter(pc.and_(pc.equal(fa["pid"], truth["pid"]), pc.equal(fa["syscall"].cast("string"), "pread64")))
            s = run["sampling"]["file_io"]
            extra = {"sampling": sampling, "agg_calls": int(pc.sum(fa["calls"]).as_py() or 0),
                     "raw_weight": int(pc.sum(mine_rows["weight"]).as_py() or 0), "lost_weight": s["lost_weight"],
                     "max_n": s["max_n"], "sampled_s": s["sampled_s"]}
        return {**extra,
            "target_rate": rate or "max",
            "producer_calls": truth["calls"],
            "producer_rate": round(truth["rate"]),
            "decoded_events": mine,
            "decoded_per_s": round(mine / truth["seconds"]),
            "lost": lost,
            "lost_by_table": run["lost_events"],
            "dropped": run["dropped_events"],
            "accounted": mine + lost == truth["calls"],
            "agent_wall_s": round(wall, 2),
        }


def agent_throughput(path: str, events: int) -> dict:
    """The agent's own rate: fill a large ring buffer while nothing reads it, then time
    read + decode + Parquet write of every record, on one core, with no producer running."""
    from kvtrace.capture import program
    from kvtrace.capture.loader import Source
    from kvtrace.dataset.writer import DatasetWriter
    from kvtrace.pipeline import Pipeline

    plan = program.plan(["fileio"], ringbuf_pages=32768, trace_writes=False)  # 128 MiB
    src = Source(plan)
    prod = subprocess.Popen([PY, "-c", "import os,sys; sys.stdin.read(1)\nfd=os.open(sys.argv[1],0)\n"
                             "for i in range(int(sys.argv[2])): os.pread(fd,64,0)", path, str(events)], stdin=subprocess.PIPE)
    src.add_target(prod.pid)
    prod.stdin.write(b"g")
    prod.stdin.close()
    prod.wait()
    with tempfile.TemporaryDirectory() as d:
        pipe = Pipeline(src, plan, DatasetWriter(d, "bench", "h"), [prod.pid], fresh_pids=(prod.pid,))
        t0 = time.perf_counter()
        batch = src.drain()
        t1 = time.perf_counter()
        tables = pipe.decode(batch)
        t2 = time.perf_counter()
        for name, t in tables.items():
            pipe.writer.add(name, t)
        pipe.writer.flush(pipe.run_row("bench"))
        t3 = time.perf_counter()
        n = tables["file_io"].num_rows
        lost = src.lost()
    src.close()
    return {
        "events": n, "lost": sum(lost.values()),
        "read_per_s": round(n / (t1 - t0)), "decode_per_s": round(n / (t2 - t1)),
        "write_per_s": round(n / (t3 - t2)), "total_per_s": round(n / (t3 - t0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true", help="CI mode: short runs, fewer rates")
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    seconds = 1.0 if a.short else 4.0
    rates = [20_000, 0] if a.short else [50_000, 100_000, 200_000, 400_000, 0]
    path = "/dev/shm/kvtrace-bench"
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    base = untraced(path, seconds)
    rows = [traced(path, seconds, r) for r in rates]
    flat = rows[-1]
    # the default, --sampling auto, flat out on a small ring: raw rows sampled once reserves
    # fail, the in-kernel file_agg count complete
    auto = traced(path, seconds, 0, ringbuf_pages=64, sampling="auto")
    result = {
        "agent_throughput": agent_throughput(path, 100_000 if a.short else 1_000_000),
        "untraced_calls_per_s": round(base["rate"]),
        "traced_calls_per_s": flat["producer_rate"],
        "per_event_cost_us": round((1 / flat["producer_rate"] - 1 / base["rate"]) * 1e6, 3),
        "rates": rows,
        "auto_sampling": auto,
    }
    os.unlink(path)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
