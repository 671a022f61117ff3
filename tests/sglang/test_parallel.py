"""kvtrace attached to SGLang 0.5.23 (CPU engine) with tensor parallelism (`--tp-size 2`) and
with data parallelism (`--dp-size 2`), checked against SGLang's own answers
(``meta_info.cached_tokens`` of /generate) and its /metrics.

On this 2-core VM SGLang's CPU engine refuses more ranks than NUMA nodes unless each rank's cores
are given: ``SGLANG_CPU_OMP_THREADS_BIND=0|1`` (sglang/srt/utils/numa_utils.py,
init_threads_binding).

TP: two schedulers, ``sglang::scheduler_TP0`` and ``_TP1``, each with a replica of the same
radix tree (rank 0 receives the requests and broadcasts them).  One engine: the hook goes into
TP rank 0 only, rank 1 is traced as a worker (kvtrace.servers.sglang.discover).  Workload, one
request at a time, a 600-token prefix shared:
  T0  prefix + s0   cold: 699 cold, 1 tail (SGLang computes a prompt's last token)
  T1  prefix + s1   hit 600
  T2  prefix + s2   hit 600
  T3  T0 again      hit 699

DP: two schedulers, ``sglang::scheduler_DP0`` and ``_DP1``, each its own radix tree; each
request pinned to a rank by /generate's ``routed_dp_rank``:
  A0  prefix + s0  -> rank 0   cold
  A1  prefix + s1  -> rank 1   the prefix is on rank 0 only: miss_other_engine 600
  A2  prefix + s2  -> rank 1   hit 600
  A3  prefix + s1  -> rank 0   hit 600; s1 is on rank 1 only: miss_other_engine 99
Each server runs its workload and is stopped before the next one starts (on 2 cores an idle
SGLang scheduler polls at 100% of one).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo.sglang_server import SglangServer
from tests import helpers
from tests.sglang.conftest import STUB, sglang_skip_reason
from tests.sglang.test_sglang import settled
from tests.vllm.conftest import free_port

pytestmark = [pytest.mark.root, pytest.mark.long]

REPO = Path(__file__).resolve().parents[2]
PREFIX, SUFFIX = 600, 100
PROMPT = PREFIX + SUFFIX
CACHED = "sglang:cached_tokens_total"
TP_PLAN = [("T0", "s0"), ("T1", "s1"), ("T2", "s2"), ("T3", "s0")]
DP_PLAN = [("A0", "s0", 0), ("A1", "s1", 1), ("A2", "s2", 1), ("A3", "s1", 0)]


def prompts(seed: int) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    new = lambda n: [rnd.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    prefix = new(PREFIX)
    return {f"s{i}": prefix + new(SUFFIX) for i in range(3)}


def generate(srv: SglangServer, ids: list[int], rid: str, dp_rank: int | None = None) -> dict:
    """POST /generate (greedy, 4 tokens), pinned to a DP rank when given: SGLang's meta_info."""
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    if dp_rank is not None:
        body["routed_dp_rank"] = dp_rank
    req = urllib.request.Request(f"{srv.url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["meta_info"]


def schedulers(srv: SglangServer) -> dict[str, int]:
    """SGLang's schedulers by the rank in their title ("TP1", "DP0"): pid."""
    out = {}
    for c in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            name = c.name()
        except psutil.Error:
            continue
        if name.startswith("sglang::scheduler_"):
            out[name.removeprefix("sglang::scheduler_")] = c.pid
    return out


def kvtrace(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def serve_and_record(base: Path, flag: str, plan, engines: int) -> dict:
    """Start SGLang with ``flag 2``, attach kvtrace, run ``plan``; everything read from the live
    server (its ranks, `kvtrace servers`, /metrics) is taken before it is stopped."""
    reason = sglang_skip_reason()
    if reason:
        pytest.skip(reason)
    srv = SglangServer(args=["--chunked-prefill-size", "256", "--max-total-tokens", "3000", flag, "2"],
                       port=free_port(8100, 8179), workdir=base / "server", stub=STUB,
                       env={"SGLANG_PLUGINS": "none", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    t0 = time.monotonic()
    srv.start(timeout=600)
    ready = time.monotonic() - t0
    try:
        ranks = schedulers(srv)
        listed = kvtrace("servers", "--json")
        assert listed.returncode == 0, listed.stderr[-2000:]
        (info,) = [s for s in json.loads(listed.stdout) if s["port"] == srv.port]
        ps, meta = prompts(23), {}
        before = settled(srv, (CACHED,))[CACHED]
        with helpers.Attached(srv.port, base / "ds", engines=engines) as att:
            for rid, p, *rank in plan:
                meta[rid] = generate(srv, ps[p], rid, *rank)
            time.sleep(1.5)
        after = settled(srv, (CACHED,))[CACHED]
        log = att.err.read_text(errors="replace")
    finally:
        srv.stop()
    return {"ds": Dataset.open(base / "ds"), "meta": meta, "ranks": ranks, "info": info, "log": log,
            "cached_delta": after - before, "ready_s": ready, "dir": base / "ds"}


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    return serve_and_record(tmp_path_factory.mktemp("sglang-tp"), "--tp-size", TP_PLAN, engines=1)


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    return serve_and_record(tmp_path_factory.mktemp("sglang-dp"), "--dp-size", DP_PLAN, engines=2)


def causes(ds) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for t in ds.table("token_causes").to_pylist():
        if t["attempt"] == 0:
            out.setdefault(t["request"], Counter())[t["cause"]] += t["tokens"]
    return out


def analyze(run) -> dict:
    p = kvtrace("analyze", str(run["dir"]), "--json", timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


# --- tensor parallelism ------------------------------------------------------------------------


def test_tp_one_engine_hits_equal_sglangs(tp):
    """One admission per request, from TP rank 0's scheduler, with SGLang's cached tokens; the
    requests table and the miss causes agree (nothing on "another engine": rank 1 is a replica)."""
    ds, meta, ranks = tp["ds"], tp["meta"], tp["ranks"]
    assert set(ranks) == {"TP0", "TP1"}, ranks
    assert not ds.problems, ds.problems
    cached = {rid: m["cached_tokens"] for rid, m in meta.items()}
    assert cached == {"T0": 0, "T1": PREFIX, "T2": PREFIX, "T3": PROMPT - 1}   # SGLang's own answer
    admits = [a for a in ds.table("admit").to_pylist() if a["attempt"] == 0]
    assert sorted(a["request"] for a in admits) == sorted(meta)                 # once each, not per rank
    assert {a["pid"] for a in admits} == {ranks["TP0"]}
    assert {a["request"]: a["cached_local"] for a in admits} == cached
    assert {a["request"]: a["prompt_len"] for a in admits} == {rid: m["prompt_tokens"] for rid, m in meta.items()}
    req = {r["request"]: r for r in ds.table("requests").to_pylist()}
    assert {rid: req[rid]["cached_tokens"] for rid in meta} == cached
    assert {rid: req[rid]["prefill_tokens"] for rid in meta} == {rid: PROMPT - c for rid, c in cached.items()}
    assert {rid: req[rid]["miss_other_engine"] for rid in meta} == dict.fromkeys(meta, 0)
    by = causes(ds)
    assert by == {"T0": {"miss_cold": PROMPT - 1, "miss_tail": 1},
                  "T1": {"hit_local": PREFIX, "miss_cold": SUFFIX - 1, "miss_tail": 1},
                  "T2": {"hit_local": PREFIX, "miss_cold": SUFFIX - 1, "miss_tail": 1},
                  "T3": {"hit_local": PROMPT - 1, "miss_tail": 1}}
    assert [e["pid"] for e in ds.table("engine").to_pylist()] == [ranks["TP0"]]
    stats = ds.table("hook_stats").to_pylist()
    assert stats and stats[-1]["errors"] == 0 and stats[-1]["dropped"] == 0, stats[-1]
    assert sum(cached.values()) == tp["cached_delta"]   # sglang:cached_tokens_total


def test_tp_both_ranks_traced_hook_in_rank_0(tp):
    """`kvtrace servers` names rank 0 the engine and rank 1 a worker; both are traced, the hook
    injected once."""
    ranks, info = tp["ranks"], tp["info"]
    assert info["engine_pids"] == [ranks["TP0"]] and info["worker_pids"] == [ranks["TP1"]], info
    (run,) = tp["ds"].table("runs").to_pylist()
    assert {ranks["TP0"], ranks["TP1"]} <= set(run["pids"]), run["pids"]
    assert tp["log"].count("injected in engine") == 1, tp["log"]
    assert f"SGLang hook injected in engine {ranks['TP0']}" in tp["log"]


def test_tp_analyze_totals(tp):
    rep = analyze(tp)
    hits = sum(m["cached_tokens"] for m in tp["meta"].values())
    assert (rep["reuse"]["requests"], rep["reuse"]["prompt_tokens"], rep["reuse"]["hit_tokens"]) == \
        (4, 4 * PROMPT, hits) == (4, 2800, 1899)
    assert "engines" not in rep   # one engine, not one per rank
    first = rep["misses"]["first"]
    assert (first["miss_cold"], first["miss_tail"], first["miss_other_engine"]) == (897, 4, 0)


# --- data parallelism --------------------------------------------------------------------------


def test_dp_each_engines_hits_and_misses_cached_on_the_other(dp):
    ds, meta, ranks = dp["ds"], dp["meta"], dp["ranks"]
    assert set(ranks) == {"DP0", "DP1"}, ranks
    assert not ds.problems, ds.problems
    cached = {rid: m["cached_tokens"] for rid, m in meta.items()}
    assert cached == {"A0": 0, "A1": 0, "A2": PREFIX, "A3": PREFIX}   # SGLang's own answer
    admits = {a["request"]: a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    assert {rid: a["cached_local"] for rid, a in admits.items()} == cached
    assert {rid: a["pid"] for rid, a in admits.items()} == {rid: ranks[f"DP{rank}"] for rid, _, rank in DP_PLAN}
    req = {r["request"]: r for r in ds.table("requests").to_pylist()}
    assert {rid: req[rid]["cached_tokens"] for rid in meta} == cached
    assert {rid: req[rid]["miss_other_engine"] for rid in meta} == {"A0": 0, "A1": PREFIX, "A2": 0, "A3": SUFFIX - 1}
    assert {rid: req[rid]["miss_cold"] for rid in meta} == {"A0": PROMPT - 1, "A1": SUFFIX - 1, "A2": SUFFIX - 1, "A3": 0}
    assert {rid: req[rid]["miss_tail"] for rid in meta} == dict.fromkeys(meta, 1)
    other = {t["request"]: t["other_engine"] for t in ds.table("token_causes").to_pylist()
             if t["cause"] == "miss_other_engine"}
    assert other == {"A1": ranks["DP0"], "A3": ranks["DP1"]}
    by = causes(ds)
    assert {rid: sum(c.values()) for rid, c in by.items()} == dict.fromkeys(meta, PROMPT)
    assert {rid: c["hit_local"] for rid, c in by.items()} == cached
    assert sorted(e["pid"] for e in ds.table("engine").to_pylist()) == sorted(ranks.values())
    assert sum(cached.values()) == dp["cached_delta"]   # sglang:cached_tokens_total, both ranks


def test_dp_both_schedulers_are_engines(dp):
    ranks, info = dp["ranks"], dp["info"]
    assert sorted(info["engine_pids"]) == sorted(ranks.values()) and info["worker_pids"] == [], info
    assert info["kv_events"] is None
    assert all(f"SGLang hook injected in engine {pid}" in dp["log"] for pid in ranks.values()), dp["log"]


def test_dp_analyze_gives_each_engine_its_own_figures(dp):
    rep = analyze(dp)
    engines = {e["engine_pid"]: e for e in rep["engines"]}
    assert set(engines) == set(dp["ranks"].values())
    assert sorted((e["requests"], e["prompt_tokens"], e["hit_tokens"]) for e in engines.values()) == \
        [(2, 2 * PROMPT, PREFIX), (2, 2 * PROMPT, PREFIX)]
    assert rep["reuse"]["hit_tokens"] == sum(m["cached_tokens"] for m in dp["meta"].values()) == 1200
    assert rep["misses"]["first"]["miss_other_engine"] == PREFIX + SUFFIX - 1
