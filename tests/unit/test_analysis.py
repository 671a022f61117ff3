"""`kvtrace analyze` and `kvtrace whatif` on constructed datasets with hand-computed answers
(tests/unit/analysis_fixture.py derives each number), bad input, and DuckDB == Spark."""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.analysis import render
from kvtrace.analysis.report import analyze

from . import analysis_fixture as fx
from .analysis_fixture import MS, png_pixels

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return fx.build(tmp_path_factory.mktemp("an") / "ds")


@pytest.fixture(scope="module")
def rep(ds) -> dict:
    return analyze(ds)


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------------------------------------
# Figures


def test_hit_rate_counted_at_admission_only(rep):
    r = rep["reuse"]
    # A 0 + B 480 + E 0 + D 0 + C 480 local, F 384 from storage, over 600+600+300+700+600+400 prompt tokens
    assert (r["requests"], r["prompt_tokens"], r["hit_local"], r["hit_external"]) == (6, 3200, 960, 384)
    assert r["hit_rate"] == 1344 / 3200 and r["local_rate"] == 0.3 and r["external_rate"] == 0.12
    nc = r["not_counted"]
    # the re-admission after preemption reused 288 and recomputed [288, 311): never a hit
    assert (nc["readmissions"], nc["readmission_reused_tokens"], nc["recomputed_after_preemption_tokens"]) == (1, 288, 23)
    # a request's own earlier chunks: A [250,500) [500,600) and D [512,700) are computed, not hit
    assert (nc["later_chunks"], nc["later_chunk_tokens"]) == (3, 538)
    per = {x["request"]: x for x in r["per_request"]}
    assert len(r["per_request"]) == 6, "the admission sent twice (scheduler retry) counted twice"
    assert per["B"]["hit_rate"] == 0.8 and per["F"]["cached_external"] == 384 and per["A"]["hit_rate"] == 0
    assert (per["E"]["readmissions"], per["E"]["readmit_reused"]) == (1, 288)


def test_hit_rate_by_chunk_index_and_size(rep):
    bi = [(x["chunk_index"], x["chunks"], x["computed"], x["hit"]) for x in rep["reuse"]["by_chunk_index"]]
    assert bi == [(0, 6, 250 + 120 + 300 + 512 + 120 + 16, 1344), (1, 2, 250 + 188, 0), (2, 1, 100, 0)]
    assert rep["reuse"]["by_chunk_index"][0]["hit_share"] == round(1344 / (1344 + 1318), 6)
    bs = [(x["first_chunk_tokens_le"], x["requests"], x["prompt_tokens"], x["hit_tokens"]) for x in rep["reuse"]["by_first_chunk_size"]]
    assert bs == [(32, 1, 400, 384), (128, 2, 1200, 960), (256, 1, 600, 0), (512, 2, 1000, 0)]


def test_chunking_versus_blocks(rep):
    c = rep["chunking"]
    assert rep["block_size"] == 32
    # non-final chunks end at 250 (26 past a block edge), 500 (20) and 512 (0)
    assert c["partial_blocks"] == {"chunks_not_last": 3, "mid_block_ends": 2, "partial_tokens": 46}
    # prompt tails: 600 % 32 = 24 (x3), 700 % 32 = 28, 300 % 32 = 12, 400 % 32 = 16
    assert c["prompt_tails"] == {"requests": 6, "with_tail": 6, "tail_tokens": 128}
    inf = c["inflight"]
    assert (inf["requests"], inf["missed_tokens"]) == (1, 96)
    (row,) = inf["rows"]
    assert (row["request"], row["hit_blocks"], row["shared_blocks"], row["suppliers"]) == ("B", 15, 18, 1)


def test_eviction_rereference_and_thrash(rep):
    e = rep["chunking"]["evictions"]
    assert (e["evictions"], e["rereferenced"]) == (6, 5)
    assert e["outcomes"] == {"lost": {"blocks": 3, "tokens": 96}, "reloaded": {"blocks": 2, "tokens": 64}}
    assert (e["thrash_blocks"], e["thrash_tokens"], e["thrash_rate"]) == (3, 96, 0.5)
    d = e["distance"]
    # lost: 80.3 ms -> step 10 start (100 ms), 2 steps; reloaded: 90.3 ms -> step 12 (120 ms), 3 steps
    assert (d["n"], d["dt_p50"], d["dt_p90"], d["dt_p99"], d["steps_p50"], d["steps_p90"]) == \
        (5, int(19.7 * MS), int(29.7 * MS), int(29.7 * MS), 2, 3)
    assert e["histogram"] == [{"bucket": "10-100ms", "outcome": "lost", "blocks": 3},
                              {"bucket": "10-100ms", "outcome": "reloaded", "blocks": 2}]


def test_time_per_chunk_and_verdict(rep):
    t = rep["timing"]
    c = t["components_ns"]
    # queue: A 5+2+2, B 8, E 5 and 9.8 (since its preemption), D 5+2, C 5, F 10 ms; 10 x 0.5 ms schedule()
    assert t["chunks"] == 10
    assert (c["queue_ns"], c["sched_ns"], c["storage"], c["compute"]) == (int(53.8 * MS), 5 * MS, 2 * MS, int(74.5 * MS))
    assert c["queueing"] == int(58.8 * MS) and c["recompute_ns"] == int(7.5 * MS)
    assert t["verdict_counts"] == {"compute": 7, "queueing": 3}
    per = {(x["request"], x["attempt"], x["chunk_index"]): x for x in t["per_chunk"]}
    assert per[("F", 0, 0)]["storage_ns"] == 2 * MS and per[("F", 0, 0)]["compute_ns"] == 7 * MS
    assert per[("F", 0, 0)]["verdict"] == "queueing" and per[("E", 1, 0)]["queue_ns"] == int(9.8 * MS)
    assert per[("A", 0, 0)]["verdict"] == "compute"
    v = rep["verdict"]
    assert v["bottleneck"] == "compute"
    assert v["evidence"][0] == "compute 0.074 s = 55.1% of chunk time over 10 chunks"
    assert any("recompute after preemption" in e for e in v["evidence"])


def test_storage_reload_prefetch_service(rep):
    blk = rep["storage"]["block_io"][0]
    assert (blk["disk"], blk["ios"], blk["bytes"]) == ("nvme0n1", 4, 16384)
    assert (blk["lat_p50"], blk["lat_p95"], blk["lat_p99"]) == (200_000, 400_000, 400_000)
    rr = rep["reload_vs_recompute"]
    assert rr["reload"]["tokens"] == 384 and rr["reload"]["load_ns"] == 2 * MS
    assert rr["reload"]["ns_per_token"] == round(2e6 / 384, 6)
    # prefill-only steps 1-4, 7-10, 12: 8 x 7.5 ms + 7 ms of compute over 1,879 tokens
    assert (rr["recompute"]["compute_ns"], rr["recompute"]["tokens"]) == (67 * MS, 1879)
    assert rr["speedup"] == round((67e6 / 1879) / (2e6 / 384), 6)
    pf = rep["prefetch"]
    assert pf["read_ns_per_block"] == round(2e6 / 12, 6)
    assert pf["reloaded_hideable_ns"] == round(2 * 2e6 / 12, 6) and pf["lost_prefetchable_ns"] == 500_000
    assert pf["from_arrival"] == {"requests": 1, "load_ns": 2 * MS, "hideable_ns": 2 * MS}
    s = rep["service"]
    # TTFT: C 13, E 13, B 16, F 19.5, D 23, A 33 ms
    assert (s["ttft_p50_ns"], s["ttft_p90_ns"], s["ttft_p99_ns"]) == (16 * MS, 33 * MS, 33 * MS)
    assert s["window_ns"] == int(119.5 * MS) and s["output_tokens"] == 7 + 7 and s["prompt_tokens"] == 3200
    assert s["storage_read_gb_per_s"]["kv_load_bytes"] == round(786432 / 0.1195 / 1e9, 6)


def test_gaps_stated_without_arrivals_and_prompts(tmp_path):
    rep = analyze(fx.build(tmp_path / "ds", with_prompts=False, with_arrivals=False))
    assert any("no arrive records" in g for g in rep["gaps"])
    assert any("no prompt_blocks records" in g for g in rep["gaps"])
    assert any("6 of 6 requests have no arrival time" in g for g in rep["gaps"])
    assert rep["chunking"]["inflight"]["requests"] == 0 and rep["reuse"]["hit_rate"] == 1344 / 3200
    assert rep["block_size"] == 32  # from the hits: 480 tokens / 15 blocks


def test_html_is_self_contained(rep, tmp_path):
    page = render.to_html(rep)
    assert page.count("<svg") >= 5
    assert not re.search(r"<script|\b(src|href)\s*=|https?://(?!www\.w3\.org/2000/svg)", page)


def test_html_renders_in_chromium(rep, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    page = tmp_path / "r.html"
    page.write_text(render.to_html(rep))
    shot = tmp_path / "r.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
                    "--window-size=1280,1600", page.as_uri()], capture_output=True, timeout=120, check=True)
    w, h, px = png_pixels(shot)
    counts: dict = {}
    for p in px:
        counts[p] = counts.get(p, 0) + 1
    assert (w, h) == (1280, 1600)
    assert counts.get(bytes.fromhex("4e79a7"), 0) > 1000  # compute bars
    assert counts.get(bytes.fromhex("59a14f"), 0) > 300   # hit-rate bars
    assert counts.get(bytes.fromhex("e15759"), 0) > 100   # lost re-references


def test_cli_json_and_terminal(ds):
    r = cli("analyze", ds, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reuse"]["hit_local"] == 960
    r = cli("analyze", ds)
    assert r.returncode == 0 and "bottleneck" in r.stdout and "42.00%" in r.stdout


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file, non-zero exit; partial datasets analysed with gaps stated


def one_line_error(r: subprocess.CompletedProcess, code: int = 6) -> str:
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_missing_and_empty_dataset(tmp_path):
    assert "no dataset at" in one_line_error(cli("analyze", tmp_path / "nope"))
    (tmp_path / "empty" / "step").mkdir(parents=True)
    assert "empty dataset" in one_line_error(cli("analyze", tmp_path / "empty"))


def test_kernel_only_dataset(tmp_path):
    root = tmp_path / "k"
    fx.build(root)
    for t in ("step", "chunk", "admit", "evict", "preempt", "kv_load", "arrive", "prompt_blocks"):
        shutil.rmtree(root / t)
    msg = one_line_error(cli("analyze", root))
    assert "has no hook records" in msg and "step, chunk, admit" in msg and "only kernel tables (block_io)" in msg


def test_truncated_file_is_named_and_left_out(tmp_path):
    root = fx.build(tmp_path / "t")
    f = next((root / "kv_load").rglob("*.parquet"))
    f.write_bytes(f.read_bytes()[:100])
    r = cli("analyze", root, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert any(str(f) in g and "truncated or corrupt" in g for g in rep["gaps"])
    assert str(f) in r.stderr  # the gap is also said on stderr
    assert rep["reload_vs_recompute"]["reload"]["tokens"] == 0 and rep["reuse"]["hit_external"] == 384


def test_truncated_required_table(tmp_path):
    root = fx.build(tmp_path / "t")
    f = next((root / "chunk").rglob("*.parquet"))
    f.write_bytes(f.read_bytes()[:-20])
    assert "chunk" in one_line_error(cli("analyze", root))


def test_corrupt_page_is_found_by_name(tmp_path):
    root = fx.build(tmp_path / "c")
    f = next((root / "evict").rglob("*.parquet"))
    data = bytearray(f.read_bytes())
    for i in range(8, 120):  # the first data page, footer intact
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))
    r = cli("analyze", root, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert any(str(f) in g for g in rep["gaps"]), rep["gaps"]
    assert rep["chunking"]["evictions"]["evictions"] == 0


def test_mixed_schema_versions(tmp_path):
    root = fx.build(tmp_path / "m")
    fx.write(root, "step", [fx.step_row(20, 10, 0)], name="r2", run="r2", version=3)
    msg = one_line_error(cli("analyze", root))
    assert "schema version 3" in msg and "r2.parquet" in msg and "reads versions 1 and 2" in msg


def test_whatif_bad_input(tmp_path, ds):
    assert "no prompt_blocks records" in one_line_error(cli("whatif", fx.build(tmp_path / "np", with_prompts=False)))
    msg = one_line_error(cli("whatif", ds, "--block-size", "48"), code=2)
    assert "multiple of the recorded block size 32" in msg
    assert "not a whole number" in one_line_error(cli("whatif", ds, "--chunk-size", "abc"), code=2)


# ---------------------------------------------------------------------------------------------
# whatif: the replay model on a workload small enough to follow block by block


def whatif_ds(root: Path) -> Path:
    """Four requests 1 s apart (no overlap), 96-token prompts (3 blocks), 1 output token:
    R1 [a1 a2 a3], R2 [a1 a2 x3], R3 [c1 c2 c3], R4 [a1 a2 a3]."""
    a1, a2, a3, x3, c1, c2, c3 = (1 << 63 | i for i in range(1, 8))
    chains = {"R1": [a1, a2, a3], "R2": [a1, a2, x3], "R3": [c1, c2, c3], "R4": [a1, a2, a3]}
    fx.write(root, "prompt_blocks", [fx.hook({"step": i + 1, "request": r, "block_size": 32, "prompt_len": 96,
                                              "max_output": 1, "num_blocks": 3, "first": 0, "hashes": c})
                                     for i, (r, c) in enumerate(chains.items())])
    fx.write(root, "arrive", [fx.hook({"step": i + 1, "t_ns": (i + 1) * 1000 * MS, "request": r, "traceparent": "",
                                       "tracestate": ""}) for i, r in enumerate(chains)])
    fx.write(root, "admit", [fx.admit(i + 1, r, 96, 0) for i, r in enumerate(chains)])
    fx.write(root, "chunk", [fx.chunk(i + 1, r, 0, 96, 96, 0, True) for i, r in enumerate(chains)])
    fx.write(root, "step", [fx.step_row(i + 1, 96, 0) for i in range(4)])
    fx.write(root, "runs", [fx.run_row()], sch=fx.schema.RUNS)   # a vLLM server's run
    return root


def test_whatif_replay_block_by_block(tmp_path):
    from kvtrace.analysis import whatif

    root = whatif_ds(tmp_path / "w")
    res = whatif.run(root, chunk_sizes=[256], cache_blocks=[7, 5], tiers=["none", "file"])
    p = {(r["cache_blocks"], r["storage_tier"]): r for r in res["predictions"]}
    # 6 usable blocks: R2 hits a1 a2 (the last block is never hit); R3 evicts a3; R4 hits a1 a2 and evicts x3
    big = p[(7, "none")]
    assert (big["hit_local"], big["hit_external"], big["evictions"], big["recomputed_tokens"]) == (128, 0, 2, 32)
    assert round(big["hit_rate"], 6) == round(128 / 384, 6) and big["requests"] == 4 and big["prompt_tokens"] == 384
    # 4 usable blocks: R3 evicts a3, x3, a2; R4 hits a1 only and evicts c3, c2
    small = p[(5, "none")]
    assert (small["hit_local"], small["evictions"], small["recomputed_tokens"]) == (96, 5, 64)
    # with a file tier R4 loads a2 back (a3 stays beyond the hittable two blocks)
    tier = p[(5, "file")]
    assert (tier["hit_local"], tier["hit_external"], tier["storage_loads"]) == (96, 32, 1)
    assert res["recorded"]["block_size"] == 32 and res["recorded"]["chunk_size"] == 96
    assert all(r["lookups"] > 0 for r in res["predictions"])


def test_whatif_block_size_multiple(tmp_path):
    from kvtrace.analysis import whatif

    root = whatif_ds(tmp_path / "w")
    (r,) = whatif.run(root, chunk_sizes=[256], block_sizes=[64], cache_blocks=[7])["predictions"]
    # 64-token blocks: 1 full block per prompt, hittable (95 // 64 = 1): R2 and R4 hit [a1 a2]
    assert (r["hit_local"], r["evictions"]) == (128, 0)


# ---------------------------------------------------------------------------------------------
# The same report from Spark


@pytest.mark.slow
@pytest.mark.long   # Apache Spark, the second SQL engine: make test-long
def test_spark_report_equals_duckdb(ds, rep):
    fx.assert_spark_report_equals(ds, rep)


def test_sampled_kernel_rows_count_by_weight(tmp_path):
    root = fx.build(tmp_path / "w")
    f = next((root / "block_io").rglob("*.parquet"))
    import pyarrow.parquet as pq
    import pyarrow as pa

    t = pq.read_table(f)
    meta = t.schema.metadata
    t = t.set_column(t.column_names.index("weight"), "weight", pa.array([3] * t.num_rows, pa.uint32()))
    pq.write_table(t.replace_schema_metadata(meta), f)
    blk = analyze(root)["storage"]["block_io"][0]
    # 4 sampled reads standing for 3 each; latency percentiles stay those of the rows kept
    assert (blk["ios"], blk["bytes"], blk["busy_ns"], blk["lat_p50"]) == (12, 3 * 16384, 3 * 1_000_000, 200_000)


def test_whatif_free_queue_keeps_the_order_of_an_ordered_dict():
    """The replay's free-block queue (versioned entries, lazy removal, compaction) against the
    per-block model it stands for: an OrderedDict popped at the front, put back at either end,
    with blocks taken out of the middle."""
    import random
    from collections import OrderedDict

    from kvtrace.analysis.whatif import FreeQueue

    for seed in range(20):
        rng = random.Random(seed)
        n = rng.randint(1, 300)
        fq, od = FreeQueue(n), OrderedDict((b, None) for b in range(n))
        taken: list = []
        for _ in range(3000):
            op = rng.random()
            if op < 0.3 and od:
                k = rng.randint(1, min(len(od), 20))
                want = [od.popitem(last=False)[0] for _ in range(k)]
                assert fq.pop(k) == want
                taken += want
            elif op < 0.5 and od:
                out = rng.sample(list(od), rng.randint(1, min(len(od), 30)))
                for b in out:
                    del od[b]
                fq.remove(out)
                taken += out
            elif taken:
                rng.shuffle(taken)
                k = rng.randint(1, len(taken))
                back, taken = taken[:k], taken[k:]
                if rng.random() < 0.7:
                    od.update((b, None) for b in back)
                    fq.extend(back)
                else:
                    for b in reversed(back):
                        od[b] = None
                        od.move_to_end(b, last=False)
                    fq.extend_front(back)
            assert len(fq) == len(od)
        assert fq.pop(len(od)) == list(od)


def lmcache_ds(root: Path, l1_chunks: int) -> Path:
    """whatif_ds with an LMCache tier of 64-token chunks (2 blocks) recorded beside it: its tiers
    row (an L1 of ``l1_chunks`` chunks) and its operations: retrieves at 1,000 ns a token, L2 reads
    at 2,000 ns a token (one key: one chunk), 2**18 bytes a token (a chunk: 2**24 bytes, 1/64 GiB)."""
    whatif_ds(root)
    tier = {"pid": 900, "tier": "lmcache", "ok": 1}
    fx.write(root, "tier_op", [
        fx.hook({**tier, "t_start_ns": 10 * MS, "t_end_ns": 10 * MS + 64_000, "request": "R1", "op": "retrieve",
                 "keys": 1, "num_tokens": 64, "nbytes": 64 << 18}, pid=900),
        fx.hook({**tier, "t_start_ns": 20 * MS, "t_end_ns": 20 * MS + 128_000, "request": "R1", "op": "l2_read",
                 "keys": 1, "num_tokens": 0, "nbytes": 64 << 18}, pid=900)])
    fx.write(root, "tiers", [{"ts_ns": MS, "kind": "lmcache", "pid": 900, "address": "127.0.0.1", "port": 8177,
                              "connector": "LMCacheMPConnector", "version": "0.5.6", "storage": "fs:/l2",
                              "chunk_tokens": 64, "same_netns": True, "memory_bytes": l1_chunks << 24}])
    return root


def test_whatif_lmcache_tier_chunk_by_chunk(tmp_path):
    """4 usable blocks (as test_whatif_replay_block_by_block): R4 finds a1 in vLLM's cache (a2 and
    a3 were evicted), and LMCache's chunk 0 ([a1 a2], stored by R1; R2 hit it, R3 stored [c1 c2]):
    it loads a2 (32 tokens: the third block is never hit).  The chunk is in L1 when L1 holds 2
    chunks ([a2-chunk, c2-chunk]): 32 tokens x 1,000 ns; with 1 chunk only c2's is there: the L2
    read of the whole chunk (64 x 2,000 ns, or 10 µs + 2**24 bytes at 1 GB/s) first."""
    from kvtrace.analysis import whatif

    root = lmcache_ds(tmp_path / "w", l1_chunks=2)
    res = whatif.run(root, chunk_sizes=[256], cache_blocks=[5],
                     tiers=["lmcache", "lmcache:0.015625", "lmcache:0.015625@1/10", "none"])
    assert res["recorded"]["storage_tier"] == "lmcache:0.03125"
    assert res["tier_model"] == {"chunk_tokens": 64, "l1_bytes": 2 << 24, "token_bytes": 1 << 18,
                                 "retrieve_ns_per_token": 1000.0, "l2_read_ns_per_token": 2000.0,
                                 "fitted_on_retrieves": 1, "fitted_on_l2_reads": 1}
    p = {r["storage_tier"]: r for r in res["predictions"]}
    got = {t: (r["hit_local"], r["hit_external"], r["storage_loads"], r["tier_l1_chunks"], r["tier_l2_chunks"],
               r["storage_wait_ns"]) for t, r in p.items() if t != "none"}
    assert got == {"lmcache": (96, 32, 1, 1, 0, 32_000),
                   "lmcache:0.015625": (96, 32, 1, 0, 1, 64 * 2000 + 32_000),
                   "lmcache:0.015625@1/10": (96, 32, 1, 0, 1, 10_000 + (1 << 24) + 32_000)}
    # L1 of 1 chunk: R3's chunk pushed R1's out, and R1's, read back for R4, pushed R3's
    assert p["lmcache:0.015625"]["tier_l1_evictions"] == 2 and p["lmcache"]["tier_l1_evictions"] == 0
    assert (p["none"]["hit_external"], p["none"]["storage_wait_ns"]) == (0, 0) and "tier_l1_chunks" not in p["none"]


def test_whatif_lmcache_settings_it_refuses(tmp_path):
    from kvtrace.analysis import whatif
    from kvtrace.errors import UsageError

    root = lmcache_ds(tmp_path / "w", l1_chunks=2)
    with pytest.raises(UsageError, match="chunk of 64 tokens is not a multiple of the block size 128"):
        whatif.run(root, chunk_sizes=[256], block_sizes=[128], cache_blocks=[5], tiers=["lmcache"])
    for bad, words in (("lmcache:0", "L1_GB must be a number of GiB above 0"), ("lmcache:x", "L1_GB must be"),
                       ("lmcache@0", "READ_GBPS must be a number above 0"), ("lmcachex", "give none, file")):
        with pytest.raises(UsageError, match=re.escape(words)):
            whatif.run(root, tiers=[bad])
