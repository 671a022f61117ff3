"""How the cost of the fleet report grows with the hosts and the requests: `analyze` (the whole
report, the fleet section included) on DuckDB and on Spark over fleet datasets of 1, 4, 16 and
64 hosts, synthesised for scale from one real run (tests/fleet/synth.py on
tests/data/recorded/fleet-router: each host a copy of that run, two vLLM replicas and 24
requests, with its own run id, pids and ports), so the requests grow with the hosts; and one
host holding 16 runs of its pair (16 hosts' requests and rows in one host partition, on that
host's two ports: the requests grown, the hosts not).

    .venv/bin/python -m tests.fleet.bench_fleet_scale [--hosts 1,4,16,64] [--spark-hosts ...]
        [--one-host-runs 16] [--repeat 3] [--json FILE]        (make bench-fleet)

What is timed is kvtrace.analysis.report.analyze in this process, the dataset's files read from
the OS cache (an untimed run first).  DuckDB: the median of --repeat runs.  Spark (local[*], as
`--engine spark` starts it): --spark-warmup untimed runs on the 1-host dataset first start the
JVM and let its JIT settle (the first run of a session takes twice as long as the third), then
one timed run per point (half a minute or more each); its report is checked equal to DuckDB's.
Seconds are wall time; CPU seconds are this process' (DuckDB's threads included) plus Spark's
JVM's, the steadier figure on a shared machine.  Printed: a markdown table (and the JSON with
--json): hosts, runs, requests, servers, files, rows (all tables), seconds per engine and the
ratio to 1 host, and the load average (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtrace.analysis.report import analyze
from kvtrace.dataset.reader import Dataset
from tests.fleet.synth import replicate

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded" / "fleet-router"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def size(root: Path) -> tuple[int, int]:
    """(files, rows) of every table, runs included (from the footers)."""
    ds = Dataset.open(root)
    names = [*ds.names(), "runs"]
    return sum(len(ds.files(n)) for n in names), sum(ds.rows(n) for n in names)


def jvm_cpu() -> float:
    """CPU seconds of Spark's JVM so far (0 before Spark starts)."""
    from kvtrace.analysis.engine import SparkEngine

    if SparkEngine._session is None:
        return 0.0
    pid = SparkEngine._session.sparkContext._gateway.proc.pid
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(root: Path, engine: str) -> tuple[float, float, dict]:
    """Wall seconds, CPU seconds (this process' threads, and Spark's JVM) and the report."""
    t0, c0, j0 = time.perf_counter(), time.process_time(), jvm_cpu()
    rep = analyze(root, engine=engine)
    return time.perf_counter() - t0, time.process_time() - c0 + jvm_cpu() - j0, rep


def comparable(rep: dict) -> dict:
    return {k: v for k, v in rep.items() if k not in ("engine", "elapsed_s", "dataset")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fleet.bench_fleet_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=RECORDED, help="the one real run copied (default: %(default)s)")
    ap.add_argument("--hosts", type=_ints, default=[1, 4, 16, 64], help="host counts, DuckDB (default 1,4,16,64)")
    ap.add_argument("--spark-hosts", type=_ints, default=None, help="host counts, Spark (default: --hosts; '' for none)")
    ap.add_argument("--one-host-runs", type=int, default=16, help="runs on one host for the requests-only point (0: none)")
    ap.add_argument("--repeat", type=int, default=3, help="DuckDB runs per point (the median is kept)")
    ap.add_argument("--spark-warmup", type=int, default=2, help="untimed Spark runs on 1 host before the first point")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args(argv)
    spark_hosts = a.hosts if a.spark_hosts is None else a.spark_hosts
    if not (a.src / "admit").is_dir():
        print(f"no dataset at {a.src}", file=sys.stderr)
        return 2
    points = [(h, 1) for h in sorted(set(a.hosts) | set(spark_hosts) | {1})]   # 1 host: the base of the ratios
    if a.one_host_runs > 1:
        points.append((1, a.one_host_runs))
    if spark_hosts:
        try:
            import pyspark  # noqa: F401
        except ImportError:
            print("no pyspark: Spark left out (pip install 'kvtrace[spark]')", file=sys.stderr)
            spark_hosts = []
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtrace-fleet-bench-") as tmp:
        t_start = time.monotonic()
        for hosts, runs in points:
            d = Path(tmp) / f"h{hosts}r{runs}"
            replicate(a.src, d, hosts, runs)
            files, rows = size(d)
            analyze(d)   # untimed: the files into the OS cache
            duck = [timed(d, "duckdb") for _ in range(max(a.repeat, 1))]
            rep = duck[-1][2]
            r = {"hosts": hosts, "runs_per_host": runs, "requests": rep["reuse"]["requests"],
                 "servers": len(rep["fleet"]["servers"]), "files": files, "rows": rows,
                 "duckdb_s": round(statistics.median(x[0] for x in duck), 3),
                 "duckdb_cpu_s": round(statistics.median(x[1] for x in duck), 3),
                 "duckdb_runs_s": [round(x[0], 3) for x in duck]}
            if (hosts in spark_hosts and runs == 1) or (runs > 1 and 1 in spark_hosts):
                if not any("spark_s" in x for x in results):
                    warm = Path(tmp) / "warm"
                    replicate(a.src, warm, 1)
                    for i in range(max(a.spark_warmup, 1)):
                        w0 = time.perf_counter()
                        analyze(warm, engine="spark")
                        print(f"# Spark warm-up {i + 1} on 1 host{' (JVM start)' if not i else ''}: "
                              f"{time.perf_counter() - w0:.1f} s", flush=True)
                s, cpu, srep = timed(d, "spark")
                r["spark_s"], r["spark_cpu_s"] = round(s, 3), round(cpu, 3)
                r["spark_same_report"] = comparable(srep) == comparable(rep)
            r["load_avg"] = [round(x, 2) for x in os.getloadavg()]
            results.append(r)
            print(json.dumps(r), flush=True)
            shutil.rmtree(d, ignore_errors=True)
        total = time.monotonic() - t_start
    base = next(r for r in results if r["hosts"] == 1 and r["runs_per_host"] == 1)
    for r in results:
        for k in ("duckdb_s", "duckdb_cpu_s", "spark_s", "spark_cpu_s"):
            if k in r and base.get(k):
                r[k.replace("_s", "_ratio")] = round(r[k] / base[k], 2)
    out = {"source": str(a.src), "cpus": os.cpu_count(), "total_s": round(total, 1), "points": results}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(table(results))
    print(f"\n{os.cpu_count()} CPUs; {total:.0f} s in all")
    return 0 if all(r.get("spark_same_report", True) for r in results) else 1


def table(results: list[dict]) -> str:
    head = ["hosts", "runs/host", "requests", "servers", "files", "rows", "DuckDB s (× 1 host)", "DuckDB CPU s (×)",
            "Spark s (×)", "Spark CPU s (×)", "Spark = DuckDB", "load avg (1 min)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(r, k, fmt):
        return f"{format(r[k + '_s'], fmt)} ({r.get(k + '_ratio', '-')})" if k + "_s" in r else "-"
    for r in results:
        cells = [r["hosts"], r["runs_per_host"], f"{r['requests']:,}", r["servers"], f"{r['files']:,}", f"{r['rows']:,}",
                 cell(r, "duckdb", ".2f"), cell(r, "duckdb_cpu", ".2f"), cell(r, "spark", ".1f"), cell(r, "spark_cpu", ".1f"),
                 {True: "yes", False: "NO"}.get(r.get("spark_same_report"), "-"), r["load_avg"][0]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
