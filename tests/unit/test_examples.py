"""The examples in examples/ run as a user runs them, on the constructed dataset of
tests/unit/analysis_fixture.py (its comments derive every number) plus kernel reads placed by the
correlator, after `kvtrace correlate`.  Each result is checked against the hand computation below
and against `kvtrace analyze`, which computes the same figures from the raw hook tables.

Added kernel I/O (all reads):
  F's KV load [120.6, 122.6] ms runs on the worker thread (tid 101): two 128 KiB block reads and two
    384 KiB preads of /var/cache/kvtrace/F.kv on that thread inside it -> thread_time, F's chunk.
  A 1,515,520-byte block read of the engine (pid 100) at 21 ms, in batched step 2 (A 250 + B 120
    tokens), naming no request -> shared: A's chunk 1 gets 250/370 = 1,024,000, B's 120/370 = 491,520.
  The fixture's four 4 KiB block reads at 200 ms fall in no step (none).
"""
from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtrace.analysis.report import analyze
from kvtrace.correlate.derive import correlate_dataset

from . import analysis_fixture as fx
from .analysis_fixture import MS

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
import plots  # noqa: E402
import query  # noqa: E402
import read_pandas  # noqa: E402

LOAD = 120_600_000  # F's KV load starts here (fixture: step 12's schedule end + 0.1 ms)
SHARED = 370 * 4096


def blk(start, nbytes, pid, sector, lat=200_000) -> dict:
    return {"ts_ns": start + lat, "start_ns": start, "issue_ns": start, "pid": pid, "tid": pid, "comm": "w", "dev_major": 259,
            "dev_minor": 0, "disk": "nvme0n1", "sector": sector, "bytes": nbytes, "op": "R", "rwbs": "R", "error": 0,
            "queue_ns": 0, "device_ns": lat, "latency_ns": lat}


def pread(start, offset, nbytes=393216, lat=300_000) -> dict:
    return {"ts_ns": start + lat, "start_ns": start, "pid": fx.WORKER, "tid": fx.WORKER, "syscall": "pread64", "fd": 7,
            "path": "/var/cache/kvtrace/F.kv", "offset": offset, "requested": nbytes, "iovcnt": 0, "bytes": nbytes,
            "ret": nbytes, "latency_ns": lat}


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    root = fx.build(tmp_path_factory.mktemp("ex") / "ds")
    # a second part file in the same partition, as a capture writes them between flushes
    fx.write(root, "block_io", [blk(LOAD + MS // 10, 131072, fx.WORKER, 1000), blk(LOAD + MS // 2, 131072, fx.WORKER, 2000),
                                blk(21 * MS, SHARED, fx.PID, 3000)], name="r1-p000002")
    fx.write(root, "file_io", [pread(LOAD + MS // 10, 0), pread(LOAD + MS, 393216)], name="r1-p000002")
    correlate_dataset(root)
    return root


@pytest.fixture(scope="module")
def rep(ds) -> dict:
    return analyze(ds)


def example(*args, timeout=120) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r


def rows(ds, name) -> list[dict]:
    cols, data = query.run(ds, name)
    return [dict(zip(cols, r)) for r in data]


# ---------------------------------------------------------------------------------------------
# DuckDB queries (examples/query.py, examples/queries/*.sql)

# queue = waiting + 0.5 ms schedule(): A 5 (arrives 5 ms, step 1 at 10) then 2 + 2 (since the end
# of its previous step), B 8, E 5 and 9.8 (preempted at 60.2 ms, step 7 at 70), D 5 + 2, C 5, F 10;
# execute 7.5 ms, F's 9 ms of which 2 wait for its load.  Ties (13 and 10 ms) by step.
CHUNKS = [  # request, attempt, chunk_index, step, total, queue, storage, compute, verdict
    ("F", 0, 0, 12, 19.5, 10.5, 2.0, 7.0, "queueing"), ("E", 1, 0, 7, 17.8, 10.3, 0.0, 7.5, "queueing"),
    ("B", 0, 0, 2, 16.0, 8.5, 0.0, 7.5, "queueing"), ("A", 0, 0, 1, 13.0, 5.5, 0.0, 7.5, "compute"),
    ("E", 0, 0, 4, 13.0, 5.5, 0.0, 7.5, "compute"), ("D", 0, 0, 8, 13.0, 5.5, 0.0, 7.5, "compute"),
    ("C", 0, 0, 10, 13.0, 5.5, 0.0, 7.5, "compute"), ("A", 0, 1, 2, 10.0, 2.5, 0.0, 7.5, "compute"),
    ("A", 0, 2, 3, 10.0, 2.5, 0.0, 7.5, "compute"), ("D", 0, 1, 9, 10.0, 2.5, 0.0, 7.5, "compute")]
IO_COLS = ("kv_loads", "kv_load_bytes", "kv_load_ms", "kernel_ios", "file_read_bytes", "block_read_bytes", "shared_bytes",
           "step_read_bytes")
IO = {("F", 0): (1, 786432, 2.0, 4, 2 * 393216, 2 * 131072, 0, 2 * 393216 + 2 * 131072),
      ("A", 1): (0, 0, 0.0, 0, 0, 0, 250 * 4096, SHARED), ("B", 0): (0, 0, 0.0, 0, 0, 0, 120 * 4096, SHARED)}

# first admission's hit / prompt and TTFT = end of the step of the first final chunk - arrival
REQUESTS = {"A": (0.0, 38 - 5), "B": (480 / 600, 28 - 12), "E": (0.0, 48 - 35), "D": (0.0, 98 - 75),
            "C": (480 / 600, 108 - 95), "F": (384 / 400, 129.5 - 110)}


def test_query_list_and_csv(ds, capsys):
    listing = example(EXAMPLES / "query.py", ds).stdout.splitlines()
    assert [line.split()[0] for line in listing] == ["evictions_came_back", "requests", "slowest_chunks", "ttft_by_hit_ratio"]
    query.main([str(ds), "ttft_by_hit_ratio", "--csv"])
    got = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert got[0] == ["hit_ratio", "requests", "prompt_tokens", "cached_tokens", "ttft_avg_ms", "ttft_p50_ms", "ttft_p90_ms",
                      "ttft_max_ms"]
    assert got[1:] == [[str(v) for v in r] for r in query.run(ds, "ttft_by_hit_ratio")[1]]
    query.main([str(ds), "slowest_chunks", "--limit", "3"])
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 5 and table[1].split()[:8] == ["r1", "F", "0", "0", "12", "16", "19.500", "10.500"]
    assert table[-1] == "(7 more rows: --limit 0 shows all)"


def test_slowest_chunks(ds, rep):
    got = rows(ds, "slowest_chunks")
    assert [(r["request"], r["attempt"], r["chunk_index"], r["step"], r["total_ms"], r["queue_ms"], r["storage_ms"],
             r["compute_ms"], r["verdict"]) for r in got] == CHUNKS
    for r in got:
        assert tuple(r[c] for c in IO_COLS) == IO.get((r["request"], r["chunk_index"]), (0, 0, 0.0, 0, 0, 0, 0, 0)), r
    # kvtrace analyze: the same split and verdict per chunk, and the same slowest chunks in the same order
    per = {(c["request"], c["attempt"], c["chunk_index"]): c for c in rep["timing"]["per_chunk"]}
    for r in got:
        a = per[(r["request"], r["attempt"], r["chunk_index"])]
        assert (r["total_ms"], r["queue_ms"], r["storage_ms"], r["compute_ms"], r["verdict"]) == \
            (a["total_ns"] / 1e6, (a["queue_ns"] + a["sched_ns"]) / 1e6, a["storage_ns"] / 1e6, a["compute_ns"] / 1e6, a["verdict"])
    assert [(s["request"], s["step"], s["total_ns"] / 1e6) for s in rep["storage"]["slow_chunks"]] == \
        [(r["request"], r["step"], r["total_ms"]) for r in got]


def test_evictions_came_back(ds, rep):
    got = [tuple(r.values()) for r in rows(ds, "evictions_came_back")]
    # D's allocation at step 8 (80.3 ms) evicts A's blocks 15-17 (and block 12345, never needed
    # again); C, A's prompt again, is admitted at step 10 (100 ms) with 15 blocks hit: lost.
    # At step 9 (90.3 ms) it evicts F's blocks 0 and 1; F at step 12 (120 ms) loads 12 blocks
    # from storage: reloaded.
    assert got == [("r1", 8, "D", fx.A_CHAIN[i], "C", 0, 10, i, "lost", 2, 19.7) for i in (15, 16, 17)] + \
        [("r1", 9, "D", fx.F_CHAIN[i], "F", 0, 12, i, "reloaded", 3, 29.7) for i in (0, 1)]
    e = rep["chunking"]["evictions"]
    outcomes = {}
    for r in got:
        outcomes[r[8]] = outcomes.get(r[8], 0) + 1
    assert outcomes == {k: v["blocks"] for k, v in e["outcomes"].items()} and len(got) == e["rereferenced"]
    d = e["distance"]  # 3 lost at 19.7 ms, 2 reloaded at 29.7 ms
    assert sorted(r[10] for r in got) == [d["dt_p50"] / 1e6] * 3 + [d["dt_p99"] / 1e6] * 2


def test_requests(ds, rep):
    got = rows(ds, "requests")
    assert [r["request"] for r in got] == ["A", "B", "E", "D", "C", "F"]  # in order of arrival
    assert {r["request"]: (r["hit_ratio"], r["ttft_ms"]) for r in got} == REQUESTS
    hit = {x["request"]: x["hit_rate"] for x in rep["reuse"]["per_request"]}
    ttft = {x["request"]: x["ttft_ns"] / 1e6 for x in rep["service"]["ttft_per_request"]}
    assert {r["request"]: (hit[r["request"]], ttft[r["request"]]) for r in got} == REQUESTS


def test_ttft_by_hit_ratio(ds):
    # 0-10%: A 33, E 13, D 23 ms; 80-90%: B 16, C 13; 90-100%: F 19.5 (nearest-rank percentiles)
    assert query.run(ds, "ttft_by_hit_ratio")[1] == [
        ("0-10%", 3, 1600, 0, 23.0, 23.0, 33.0, 33.0), ("80-90%", 2, 1200, 960, 14.5, 13.0, 16.0, 16.0),
        ("90-100%", 1, 400, 384, 19.5, 19.5, 19.5, 19.5)]


def test_query_errors(ds, tmp_path):
    raw = fx.build(tmp_path / "raw")  # never correlated: no derived tables
    with pytest.raises(SystemExit, match=r"has no (chunks|steps|requests|attributions) table: run `kvtrace correlate .*raw` to add"):
        query.run(raw, "slowest_chunks")
    shutil.rmtree(raw / "evict")
    with pytest.raises(SystemExit, match="has no evict table: the capture recorded none of these"):
        query.run(raw, "evictions_came_back")
    runs = raw / "runs" / "host=h1" / "date=2026-11-30" / "r1.parquet"
    t = pq.read_table(runs)
    pq.write_table(t.set_column(t.schema.get_field_index("schema_version"), "schema_version", pa.array([3], pa.int32())), runs)
    with pytest.raises(SystemExit, match=r"schema version \[3\]; these queries read versions 1 and 2"):
        query.run(raw, "requests")
    with pytest.raises(SystemExit, match="not a kvtrace dataset"):
        query.run(tmp_path / "nothing", "requests")


# ---------------------------------------------------------------------------------------------
# Plots (examples/plots.py)


def titles(svg: str, tag: str) -> list[str]:
    return re.findall(rf'<{tag} class="[a-z]+"[^>]*><title>([^<]*)</title>', svg)


def test_plots(ds, tmp_path, monkeypatch, capsys):
    out = tmp_path / "plots"
    with monkeypatch.context() as m:  # without Chromium: the SVG files and the page, no PNG
        m.setattr(plots.shutil, "which", lambda name: None)
        plots.main([str(ds), str(out)])
    assert "no Chromium found: no PNG" in capsys.readouterr().out and not (out / "plots.png").exists()
    svg = {p.stem: p.read_text() for p in out.glob("*.svg")}
    assert sorted(svg) == ["chunk_time", "hit_ratio", "ttft_vs_hit_ratio"]
    # one stacked bar per chunk, by rank: queueing, storage, compute (ms, as the report prints them)
    want = [f"{k + 1} {name}: {v:.1f} ms" if v else f"{k + 1} {name}: 0.00 ms" for k, c in enumerate(CHUNKS)
            for name, v in zip(("queueing", "storage", "compute"), c[5:8])]
    assert titles(svg["chunk_time"], "rect") == want
    heights = [float(h) for h in re.findall(r'<rect class="bar"[^>]* height="([\d.]+)"', svg["chunk_time"])]
    assert abs(sum(heights[:3]) - (plots.H - 80)) < 0.2  # the slowest chunk spans the plot's height
    # per request in order of arrival: local hit and storage hit in % of prompt tokens
    hits = dict(t.split(": ") for t in titles(svg["hit_ratio"], "rect"))
    assert {k: v for k, v in hits.items() if v != "0.00%"} == {"2 hit": "80.0%", "5 hit": "80.0%", "6 storage": "96.0%"}
    assert len(hits) == 12
    points = titles(svg["ttft_vs_hit_ratio"], "circle")
    assert sorted(points) == sorted(f"{q}: hit {100 * h:.1f}%, TTFT {t:.3f} ms" for q, (h, t) in REQUESTS.items())
    # F at x = 96% of the 640-pixel axis from x = 60; A, the longest TTFT, at 1/1.1 of the 205-pixel height
    assert 'cx="674.4"' in svg["ttft_vs_hit_ratio"] and f'cy="{235 - 205 / 1.1:.1f}"' in svg["ttft_vs_hit_ratio"]
    assert (out / "plots.html").read_text().count("<svg") == 3
    if not any(map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))):
        pytest.skip("no Chromium: the PNG is not drawn (apt-get install chromium)")
    r = example(EXAMPLES / "plots.py", ds, out)  # as a user runs it
    png = out / "plots.png"
    assert {p.stem: p.read_text() for p in out.glob("*.svg")} == svg
    w, h, px = fx.png_pixels(png)
    assert (w, h) == (plots.W, 3 * plots.H) and f"({w}x{h})" in r.stdout
    count = {}
    for p in px:
        count[p] = count.get(p, 0) + 1
    # bar areas: plot width 540 px over 10 chunks (bars 43.2 px wide) and 6 requests (72 px), 200 px
    # high; legend squares 10 x 10.  Edges are anti-aliased, so within 3%.
    storage = 43.2 * 200 * 2 / 19.5 + 72 * 200 + 2 * 100
    hit = 2 * 72 * 200 * 80 / 96 + 100
    assert abs(count[bytes.fromhex("e15759")] - storage) < 0.03 * storage
    assert abs(count[bytes.fromhex("59a14f")] - hit) < 0.03 * hit


# ---------------------------------------------------------------------------------------------
# pandas / polars (examples/read_pandas.py)


def test_read_pandas(ds, capsys):
    f = read_pandas.load(ds)
    assert {k: len(v) for k, v in f.items()} == {"runs": 1, "requests": 6, "chunks": 10, "steps": 12, "attributions": 17}
    c = read_pandas.chunk_table(f)
    assert c.iloc[0].to_dict() == {
        "request": "F", "attempt": 0, "chunk_index": 0, "step": 12, "tokens": 16, "hit_ratio": 0.96, "step_ms": 9.5,
        "storage_ms": 2.0, "load_bytes": 786432, "file_read_bytes": 786432, "block_read_bytes": 262144, "total_tokens": 16,
        "file_read_bytes_step": 786432, "block_read_bytes_step": 262144}
    # steps 1-11 are 8 ms: by step; step 2 is batched (A 250 + B 120 tokens) and holds the shared read
    assert [tuple(x) for x in c[["request", "chunk_index", "step", "total_tokens", "block_read_bytes_step"]].values[1:5]] == \
        [("A", 0, 1, 250, 0), ("A", 1, 2, 370, SHARED), ("B", 0, 2, 370, SHARED), ("A", 2, 3, 100, 0)]
    assert [tuple(x) for x in read_pandas.io_by_attribution(f).values] == [
        ("block_io", "none", 4, 4 * 4096), ("block_io", "shared", 1, SHARED), ("block_io", "thread_time", 2, 2 * 131072),
        ("file_io", "thread_time", 2, 2 * 393216)]
    arr = read_pandas.arrivals(f)
    assert list(arr["arrival"]) == [pd.Timestamp(t * MS, unit="ns", tz="UTC") for t in (5, 12, 35, 75, 95, 110)]
    read_pandas.main([str(ds)])
    out = capsys.readouterr().out
    assert "polars" in out and out.splitlines()[0] == "runs 1 rows, requests 6 rows, chunks 10 rows, steps 12 rows, attributions 17 rows"


def test_read_polars(ds):
    pytest.importorskip("polars", reason="polars is not installed (pip install polars)")
    pl_rows = read_pandas.polars_chunks(ds).rows()
    pd_rows = read_pandas.chunk_table(read_pandas.load(ds))
    assert pl_rows == [tuple(x) for x in pd_rows[["request", "attempt", "chunk_index", "step", "tokens", "hit_ratio",
                                                  "step_ms"]].itertuples(index=False)]
