"""The report's KV connector section (the hook's kv_alloc, kv_done, kv_finish and kv_invalid
records) and its check of kvtrace's hit counts against vLLM's own /metrics counters
(kvtrace.analysis.connector; docs/analysis.md, "KV connector").  Each expected number is
computed here from the rows written, by the definitions in docs/analysis.md."""
from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvtrace.analysis import render
from kvtrace.analysis.report import analyze

from . import analysis_fixture as fx
from .analysis_fixture import MS

REPO = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 65536
FILE, LMC = "FileConnector", "LMCacheConnectorV1"


def at(step: int, ms: float) -> int:
    """A time ``ms`` (to the µs) into step ``step`` (fx.step_row: step k starts at k * 10 ms)."""
    return step * 10 * MS + round(ms * 1000) * 1000


def alloc(step, request, external, first=0, is_async=0, conn=FILE, blocks=None):
    blocks = external // fx.BS if blocks is None else blocks
    return fx.hook({"step": step, "t_ns": at(step, 0.2), "request": request, "first": first, "external": external,
                    "blocks": blocks, "nbytes": blocks * BLOCK_BYTES, "async": is_async, "connector": conn})


def done(step, request, direction="load", ok=1, conn=FILE):
    return fx.hook({"step": step, "t_ns": at(step, 8.1), "request": request, "direction": direction, "ok": ok,
                    "connector": conn})


def finish(step, request, blocks, delay_free, conn=FILE):
    return fx.hook({"step": step, "t_ns": at(step, 8.2), "request": request, "blocks": blocks,
                    "nbytes": blocks * BLOCK_BYTES, "delay_free": delay_free, "connector": conn})


def invalid(step, request, blocks, conn=FILE):
    return fx.hook({"step": step, "t_ns": at(step, 8.1), "request": request, "blocks": blocks, "connector": conn})


# a: sync load of 128 tokens at step 1; b: async load of 192 tokens from step 2, done at step 4;
# c: async load from step 3 that failed at step 4, 6 of its blocks invalid; d: async from step 5,
# never done; e: another connector, sync at step 6; f: admitted at step 7, after the last scrape.
ALLOC = [alloc(1, "a", 128), alloc(1, "a", 128),   # sent twice: counted once
         alloc(2, "b", 192, first=32, is_async=1), alloc(3, "c", 256, is_async=1), alloc(5, "d", 64, is_async=1),
         alloc(6, "e", 96, conn=LMC), alloc(7, "f", 64)]
DONE = [done(4, "b"), done(4, "c", ok=0), done(4, "a", "store"), done(6, "b", "store"), done(6, "e", "store", conn=LMC)]
FINISH = [finish(3, "a", 10, 1), finish(5, "b", 8, 1), finish(6, "c", 9, 0), finish(7, "e", 4, 1, conn=LMC)]
INVALID = [invalid(5, "c", 6), invalid(5, "", 1)]
# first admissions: (step, request, prompt, local, external); a re-admission of b: not counted
ADMIT = [(1, "a", 320, 0, 128), (4, "b", 256, 32, 192), (5, "c", 300, 0, 0), (6, "e", 400, 64, 96),
         (7, "f", 200, 32, 64)]
SCRAPES = (5 * MS, 65 * MS)   # the first and last /metrics scrape: steps 1-6 start between them


def in_window(step: int) -> bool:
    return SCRAPES[0] <= step * 10 * MS <= SCRAPES[1]


def kvtrace_hits(admits, col: int) -> int:
    return sum(a[col] for a in admits if in_window(a[0]))


def build(root: Path, *, admits=ADMIT, external_rise=None, local_rise=None) -> Path:
    """Steps 1-7, a chunk and an admission per request, the connector records and two /metrics
    scrapes whose counters rose by the hits kvtrace counts in their window unless given."""
    fx.write(root, "step", [fx.step_row(k, 100, 0) for k in range(1, 8)])
    fx.write(root, "chunk", [fx.chunk(s, r, loc + ext, p - loc - ext, p, 0, True) for s, r, p, loc, ext in admits])
    fx.write(root, "admit", [fx.admit(s, r, p, loc, ext) for s, r, p, loc, ext in admits]
             + [fx.admit(7, "b", 256, 0, 64, attempt=1, prefill_len=260)])
    for table, rows in (("kv_alloc", ALLOC), ("kv_done", DONE), ("kv_finish", FINISH), ("kv_invalid", INVALID)):
        fx.write(root, table, rows)
    rise = {"vllm:external_prefix_cache_hits_total": kvtrace_hits(admits, 4) if external_rise is None else external_rise,
            "vllm:prefix_cache_hits_total": kvtrace_hits(admits, 3) if local_rise is None else local_rise}
    fx.write(root, "server_metrics", [
        {"ts_ns": ts, "kind": "vllm", "name": name, "labels": json.dumps({"engine": str(e)}), "value": 1000.0 + k * v / 2,
         "type": "counter"} for k, ts in enumerate(SCRAPES) for name, v in rise.items() for e in (0, 1)])
    fx.write(root, "runs", [fx.run_row()], sch=fx.schema.RUNS)
    return root


# ---------------------------------------------------------------------------------------------
# What the section must say, from the rows above


def once(rows, *key):
    return list({tuple(r[k] for k in key): r for r in rows}.values())


def expected_loads() -> list[dict]:
    allocs = sorted(once(ALLOC, "request", "step"), key=lambda r: (r["t_ns"], r["request"]))
    out = []
    for a in allocs:
        dn = [d for d in DONE if d["request"] == a["request"] and d["direction"] == "load" and d["t_ns"] >= a["t_ns"]]
        bad = sum(i["blocks"] for i in INVALID if i["request"] == a["request"])
        wait = (dn[0]["t_ns"] - a["t_ns"]) / 1e6 if a["async"] and dn else None
        ok = 0 if (dn and not dn[0]["ok"]) or bad else (None if a["async"] and not dn else 1)
        out.append({"run": fx.RUN, "connector": a["connector"], "request": a["request"], "step": a["step"],
                    "first": a["first"], "external": a["external"], "blocks": a["blocks"], "bytes": a["nbytes"],
                    "async": a["async"], "wait_ms": wait, "ok": ok, "invalid_blocks": bad})
    return out


def nearest_rank(values, p):
    v = sorted(values)
    return v[math.ceil(p * len(v)) - 1]


def expected_connector(name: str) -> dict:
    loads = [x for x in expected_loads() if x["connector"] == name]
    waits = [x["wait_ms"] for x in loads if x["wait_ms"] is not None]
    fin = [f for f in FINISH if f["connector"] == name]
    return {"name": name, "requests": len({x["request"] for x in loads}), "loads": len(loads),
            "external_tokens": sum(x["external"] for x in loads), "blocks": sum(x["blocks"] for x in loads),
            "bytes": sum(x["bytes"] for x in loads), "async_loads": sum(x["async"] for x in loads),
            "async_waits": len(waits), "wait_p50_ms": nearest_rank(waits, 0.5) if waits else None,
            "wait_max_ms": max(waits) if waits else None, "failed_loads": sum(x["ok"] == 0 for x in loads),
            "unfinished_loads": sum(x["ok"] is None for x in loads),
            "invalid_blocks": sum(i["blocks"] for i in INVALID if i["connector"] == name),
            "finished": {"requests": len(fin), "blocks": sum(f["blocks"] for f in fin),
                         "bytes": sum(f["nbytes"] for f in fin), "async_stores": sum(f["delay_free"] for f in fin),
                         "stores_done": sum(d["direction"] == "store" for d in DONE if d["connector"] == name)}}


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("conn") / "ds")


@pytest.fixture(scope="module")
def rep(ds) -> dict:
    return analyze(ds)


def test_the_section_totals_each_connector(rep):
    got = {c["name"]: c for c in rep["connector"]["connectors"]}
    assert sorted(got) == [FILE, LMC]
    for name in got:
        assert got[name] == expected_connector(name)
    # the figures the rows above were made to exercise, said once in plain numbers
    f = got[FILE]
    assert (f["requests"], f["loads"], f["async_loads"], f["failed_loads"], f["unfinished_loads"]) == (5, 5, 3, 1, 1)
    assert (f["async_waits"], f["wait_p50_ms"], f["wait_max_ms"]) == (2, 17.9, 27.9)
    assert f["invalid_blocks"] == 7 and f["finished"]["stores_done"] == 2


def test_the_per_request_table(rep):
    assert rep["connector"]["per_request"] == expected_loads()


def test_matching_counts_give_no_warning(rep):
    assert "warnings" not in rep
    assert not any(line.startswith("warning:") for line in rep["headline"])


def test_the_text_report_says_the_totals(rep):
    con = Console(width=400, record=True, file=io.StringIO())
    render.terminal(rep, console=con)
    text = con.export_text()
    f = expected_connector(FILE)
    assert (f"KV connector {FILE}: 5 requests loaded {f['external_tokens']:,} external tokens into {f['blocks']} "
            "blocks (1.4 MiB); 3 of 5 loads async, waited p50 17.900 ms, max 27.900 ms over 2 done; 1 failed load, "
            "7 invalid blocks; at the end 3 requests handed it 27 blocks (1.7 MiB), 2 stored async (2 done)") in text
    assert f"KV connector {LMC}: 1 request loaded 96 external tokens into 3 blocks (192.0 KiB); 0 of 1 load async;" in text
    assert "warning:" not in text


def test_a_planted_mismatch_gives_one_warning_naming_both_numbers(tmp_path):
    admits = [(s, r, p, loc, 0) for s, r, p, loc, _ in ADMIT]    # the hook saw no external hit
    rep = analyze(build(tmp_path / "ds", admits=admits, external_rise=512))
    (w,) = rep["warnings"]
    assert w.startswith("warning: kvtrace counted 0 external hit tokens, vLLM counted 512 "
                        "(vllm:external_prefix_cache_hits)")
    assert "(4 first admissions between its first and last /metrics scrape)" in w
    assert "storage hit rate (0.00%) is computed from kvtrace's count" in w
    granted = sum(a["external"] for a in once(ALLOC, "request", "step") if in_window(a["step"]))
    assert w.endswith(f"kv_alloc records granted {granted:,} external tokens in 5 loads in that window")
    assert rep["headline"].count(w) == 1
    assert rep["reuse"]["hit_external"] == 0 and rep["metrics"]["rises"]["vllm:external_prefix_cache_hits_total"] == 512


def test_local_hits_are_checked_over_the_same_window(tmp_path):
    # f's 32 local tokens (step 7) are after the last scrape: a counter that counted them differs
    rep = analyze(build(tmp_path / "ds", local_rise=kvtrace_hits(ADMIT, 3) + 32))
    (w,) = rep["warnings"]
    assert w.startswith(f"warning: kvtrace counted {kvtrace_hits(ADMIT, 3)} local prefix-cache hit tokens, vLLM "
                        f"counted {kvtrace_hits(ADMIT, 3) + 32} (vllm:prefix_cache_hits)")


def test_no_connector_records_no_section(tmp_path):
    rep = analyze(fx.build(tmp_path / "ds"))
    assert "connector" not in rep and "warnings" not in rep


def test_cli_json(ds, rep):
    r = subprocess.run([sys.executable, "-m", "kvtrace", "analyze", str(ds), "--json"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["connector"] == rep["connector"] and "warnings" not in got
    assert got["connector"]["per_request"] == expected_loads()
