"""Kernel event capacity and per-event cost on the traced process (needs root).

Two producers, each run for a series of target rates (and flat out) under `kvtrace attach`:
a pread loop of 64 B on tmpfs (one file_io event per call) and O_DIRECT preadv of 4 KiB
across a loop device (one file_io and one block_io event per call: the block layer is in
the path).  Reported per rate: events decoded per second, events lost (the kernel's count
of failed ring-buffer reserves), the producer's own call rate, and whether every call is
accounted for.  The flat-out runs are paired with untraced runs, giving the per-event cost
on the traced process as a difference of per-call times.  Then the default `--sampling
auto` at rising rates, on the default ring and on a small one: the rate where raw events
start being sampled and the in-kernel counts (file_agg) become the complete record, the
point where in-kernel aggregation takes over.

    sudo .venv/bin/python bench/capacity.py [--short] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

PY = sys.executable


def producer(path: str, seconds: float, rate: float = 0.0, direct: bool = False) -> list[str]:
    chunk = "4096" if direct else "64"
    return [PY, "-m", "kvtrace.demo.io", "pread-loop", "--path", path, "--chunk", chunk, "--seconds", str(seconds),
            "--rate", str(rate)] + (["--direct"] if direct else [])


def untraced(path: str, seconds: float, direct: bool = False) -> dict:
    out = subprocess.run(producer(path, seconds, direct=direct), check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def traced(path: str, seconds: float, rate: float, ringbuf_pages: int = 1024, sampling: str = "off",
           direct: bool = False) -> dict:
    """One attach to the producer.  ``direct``: the loop-device producer, traced with the block
    probe as well; each call is one file_io and one block_io event."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvtrace.dataset.reader import Dataset

    # os.preadv is preadv2 with flags 0 where the C library has it
    syscalls = pa.array(["preadv", "preadv2"] if direct else ["pread64"])
    probes = ["--probe", "fileio"] + (["--probe", "blockio"] if direct else [])
    with tempfile.TemporaryDirectory() as d:
        res = os.path.join(d, "r.json")
        t0 = time.monotonic()
        subprocess.run(
            [PY, "-m", "kvtrace", "attach", "--quiet", "--sampling", sampling, *probes, "--no-writes",
             "--ringbuf-pages", str(ringbuf_pages), "--out", os.path.join(d, "ds"), "--",
             *producer(path, seconds, rate, direct), "--result", res],
            capture_output=True, text=True, check=True,
        )
        wall = time.monotonic() - t0
        truth = json.load(open(res))
        ds = Dataset.open(os.path.join(d, "ds"))
        (run,) = ds.runs()
        io = ds.table("file_io")
        mine_rows = io.filter(pc.and_(pc.equal(io["path"].cast("string"), path), pc.is_in(io["syscall"].cast("string"), syscalls)))
        mine = mine_rows.num_rows
        lost = run["lost_events"].get("file_io", 0)
        extra = {}
        if direct:
            blk = ds.table("block_io") if "block_io" in ds.names() else None
            if blk is not None:
                blk = blk.filter(pc.and_(pc.equal(blk["pid"], truth["pid"]), pc.equal(blk["disk"].cast("string"), os.path.basename(path))))
            rows = 0 if blk is None else blk.num_rows
            # requests whose completion the kernel dropped before any program ran: rows without
            # latency (kvtrace.capture.blockio)
            unseen = 0 if blk is None else blk.num_rows - pc.count(blk["latency_ns"]).as_py()
            blost = run["lost_events"].get("block_io", 0)
            # the kernel does not run a program for an event that interrupts another of kvtrace's
            # programs on its CPU, and counts the skip (kvtrace.capture.progstats): a skipped
            # start is a row not written
            skips = {k: v for k, v in run["kernel_skips"].items() if k.startswith("block:")}
            missing = truth["calls"] - rows - blost
            extra = {"block_decoded": rows, "block_decoded_per_s": round(rows / truth["seconds"]), "block_lost": blost,
                     "block_unseen": unseen, "block_kernel_skips": skips, "block_missing": missing,
                     "block_accounted": 0 <= missing <= sum(skips.values())}
        if sampling != "off":
            # the in-kernel count of the producer's calls (it also holds the interpreter's own
            # few start-up calls of the same system call), and what the sampled raw rows stand for
            fa = ds.table("file_agg")
            fa = fa.filter(pc.and_(pc.equal(fa["pid"], truth["pid"]), pc.is_in(fa["syscall"].cast("string"), syscalls)))
            s = run["sampling"]["file_io"]
            extra.update({"sampling": sampling, "ringbuf_pages": ringbuf_pages, "agg_calls": int(pc.sum(fa["calls"]).as_py() or 0),
                          "raw_weight": int(pc.sum(mine_rows["weight"]).as_py() or 0), "lost_weight": s["lost_weight"],
                          "max_n": s["max_n"], "sampled_s": s["sampled_s"]})
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


@contextlib.contextmanager
def loop_device(size_mib: int = 64):
    """A loop device over a file in /dev/shm (direct I/O to the backing file where the kernel
    allows it), detached again at the end."""
    img = f"/dev/shm/kvtrace-bench-{os.getpid()}.img"
    with open(img, "wb") as f:
        f.truncate(size_mib << 20)
    dev = None
    try:
        for extra in (["--direct-io=on"], []):
            r = subprocess.run(["losetup", "--find", "--show", *extra, img], capture_output=True, text=True)
            if r.returncode == 0:
                dev = r.stdout.strip()
                break
        if dev is None:
            raise RuntimeError(f"losetup failed: {r.stderr.strip()}")
        yield dev
    finally:
        if dev:
            subprocess.run(["losetup", "-d", dev], check=False)
        os.unlink(img)


def cost_us(untraced_rate: float, traced_rate: float) -> float:
    """What tracing adds to one call, from the untraced and traced call rates (µs)."""
    return round((1 / traced_rate - 1 / untraced_rate) * 1e6, 3)


def takeover(rows: list[dict]) -> dict:
    """The first rate of an auto-sampling series at which raw events were sampled (None: the
    agent kept up with every rate)."""
    first = next((r for r in rows if r["max_n"] > 1), None)
    return {"first_sampled_rate": None if first is None else first["target_rate"],
            "first_sampled_producer_rate": None if first is None else first["producer_rate"]}


def agent_throughput(path: str, events: int) -> dict:
    """The agent's own rate: fill a large ring buffer while nothing reads it, then time
    read + decode + Parquet write of every record, on one core, with no producer running."""
    from kvtrace.capture import program
    from kvtrace.capture.loader import Source
    from kvtrace.dataset.writer import DatasetWriter
    from kvtrace.attach.pipeline import Pipeline

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
    block_rates = [5_000, 0] if a.short else [5_000, 10_000, 20_000, 40_000, 0]
    auto_rates = [50_000, 0] if a.short else [20_000, 50_000, 100_000, 200_000, 0]
    path = "/dev/shm/kvtrace-bench"
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    base = untraced(path, seconds)
    rows = [traced(path, seconds, r) for r in rates]
    flat = rows[-1]
    # the default, --sampling auto, at rising rates: on a small ring, where reserves fail and
    # raw rows are sampled, the in-kernel file_agg count complete; and on the default ring
    small = [traced(path, seconds, r, ringbuf_pages=64, sampling="auto") for r in auto_rates]
    default = [traced(path, seconds, r, ringbuf_pages=2048, sampling="auto") for r in auto_rates[-2:]]
    with loop_device() as dev:
        bbase = untraced(dev, seconds, direct=True)
        brows = [traced(dev, seconds, r, direct=True) for r in block_rates]
    result = {
        "agent_throughput": agent_throughput(path, 100_000 if a.short else 1_000_000),
        "untraced_calls_per_s": round(base["rate"]),
        "traced_calls_per_s": flat["producer_rate"],
        "per_event_cost_us": cost_us(base["rate"], flat["producer_rate"]),
        "rates": rows,
        "auto_sampling": small[-1],
        "auto_series": {"small_ring": small, "default_ring": default,
                        "takeover_small_ring": takeover(small), "takeover_default_ring": takeover(default)},
        "block": {"device": dev, "untraced_calls_per_s": round(bbase["rate"]),
                  "traced_calls_per_s": brows[-1]["producer_rate"],
                  "per_call_cost_us": cost_us(bbase["rate"], brows[-1]["producer_rate"]), "rates": brows},
    }
    os.unlink(path)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
