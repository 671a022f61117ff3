"""kvtrace attached to vLLM with data parallelism (`--data-parallel-size 2`: two EngineCores,
each with its own KV cache), checked against vLLM's responses and its per-engine /metrics.

Workload, each request pinned to a rank by vLLM's `X-data-parallel-rank` header:
  A  -> rank 0   cold
  A2 -> rank 1   the same prompt: rank 0 holds it, rank 1 does not: miss_other_engine 672, tail 32
  A3 -> rank 1   now rank 1 holds it: hit 672
  B  -> rank 1, B2 -> rank 0: the same again, the other way round
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from tests import helpers
from tests.vllm.conftest import prefix_caching, served

pytestmark = pytest.mark.root

BLOCK, PROMPT = 32, 704
TOP = BLOCK * ((PROMPT - 1) // BLOCK)   # tokens vLLM can hit at most
PLAN = [("A", "A", 0), ("A2", "A", 1), ("A3", "A", 1), ("B", "B", 1), ("B2", "B", 0)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("data-parallel")
    args = prefix_caching("--num-gpu-blocks-override", "122", "--data-parallel-size", "2", block=BLOCK)
    with served(base, args, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=900) as srv:
        yield scenario(srv, base)


def scenario(srv, base: Path) -> dict:
    rnd = random.Random(362)
    prompts = {"A": workload.tokens(rnd, PROMPT), "B": workload.tokens(rnd, PROMPT)}
    sent = {}
    with helpers.Attached(srv.port, base / "ds", engines=2):
        for rid, p, rank in PLAN:
            sent[rid] = helpers.post_completion(srv.url, srv.model, prompts[p], rid,
                                                headers={"X-data-parallel-rank": str(rank)})
        time.sleep(1.5)
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "engines": srv.processes()["engine"], "base": base}


def name(r: dict) -> str:
    return r["request"].split("-")[1]


def test_each_engines_hits_and_the_miss_cached_on_the_other_engine(run):
    ds, sent = run["ds"], run["sent"]
    cached = {n: r["usage"]["prompt_tokens_details"]["cached_tokens"] for n, r in sent.items()}
    assert cached == {"A": 0, "A2": 0, "A3": TOP, "B": 0, "B2": 0}   # vLLM's own answer
    admits = {name(a): a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    assert {n: a["cached_local"] for n, a in admits.items()} == cached
    engine_of = {n: a["pid"] for n, a in admits.items()}
    assert len(set(engine_of.values())) == 2 and engine_of["A"] != engine_of["A2"] == engine_of["A3"] == engine_of["B"]
    req = {name(r): r for r in ds.table("requests").to_pylist()}
    assert {n: req[n]["miss_other_engine"] for n in cached} == {"A": 0, "A2": TOP, "A3": 0, "B": 0, "B2": TOP}
    assert {n: req[n]["miss_cold"] for n in cached} == {"A": TOP, "A2": 0, "A3": 0, "B": TOP, "B2": 0}
    other = {name(t): t["other_engine"] for t in ds.table("token_causes").to_pylist() if t["cause"] == "miss_other_engine"}
    assert other == {"A2": engine_of["A"], "B2": engine_of["B"]}


def test_analyze_gives_each_engine_its_own_figures(run, kvtrace_cli):
    p = kvtrace_cli("analyze", str(run["ds"].root), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    engines = {e["engine_pid"]: e for e in rep["engines"]}
    assert set(engines) == set(run["engines"])
    assert sorted((e["requests"], e["prompt_tokens"], e["hit_tokens"]) for e in engines.values()) == \
        [(2, 2 * PROMPT, 0), (3, 3 * PROMPT, TOP)]
    assert rep["misses"]["first"]["miss_other_engine"] == 2 * TOP
