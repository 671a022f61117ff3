"""kvtrace attached to vLLM with ngram speculative decoding, checked against vLLM's responses
and /metrics.  A decoding request with k draft tokens is scheduled 1 + k tokens, so a step's
scheduled tokens over-count output; kvtrace counts what each request got instead.

Workload: 12 prompts of a repeated 8-token pattern (so the ngram proposer finds matches and
drafts) with a random tail, 16 output tokens each (`ignore_eos`), sent one by one.
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
from tests.vllm.test_hook import settled_metrics

pytestmark = pytest.mark.root

DRAFTS, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"
OUT, N = 16, 12
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("speculative")
    with served(base, prefix_caching("--speculative-config", json.dumps(SPEC))) as srv:
        yield scenario(srv, base)


def scenario(srv, base: Path) -> dict:
    rnd = random.Random(36)
    sent = {}
    with helpers.Attached(srv.port, base / "ds"):
        m0 = settled_metrics(srv, (DRAFTS, ACCEPTED))
        for i in range(N):
            pattern = workload.tokens(rnd, 8)
            p = pattern * 40 + workload.tokens(rnd, 5 + i)
            sent[f"s{i}"] = helpers.post_completion(srv.url, srv.model, p, f"s{i}", max_tokens=OUT, ignore_eos=True)
        m1 = settled_metrics(srv, (DRAFTS, ACCEPTED))
        time.sleep(1.5)
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "base": base,
            "drafts": m1[DRAFTS] - m0[DRAFTS], "accepted": m1[ACCEPTED] - m0[ACCEPTED]}


def test_drafts_and_accepted_tokens_equal_vllms_counters(run):
    assert run["drafts"] > 0, "the ngram proposer made no drafts: the workload does not exercise it"
    ds = run["ds"]
    steps = ds.table("spec_step").to_pylist()
    assert sum(s["drafts"] for s in steps) == run["drafts"]
    assert sum(s["accepted"] for s in steps) == run["accepted"]
    reqs = {r["request"].split("-")[1]: r for r in ds.table("spec_req").to_pylist()}
    # each request's own count: what its response says it generated
    assert {n: r["output_tokens"] for n, r in reqs.items()} == \
        {n: s["usage"]["completion_tokens"] for n, s in run["sent"].items()}
    assert sum(r["drafts"] for r in reqs.values()) == run["drafts"]
    # the drafts kept as output: accepted ones, but for those past a request's 16th token
    assert sum(r["accepted"] for r in reqs.values()) == sum(s["kept"] for s in steps) <= run["accepted"]


def test_analyze_counts_output_tokens_without_the_drafts(run, kvtrace_cli):
    p = kvtrace_cli("analyze", str(run["ds"].root), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    assert rep["service"]["output_tokens"] == sum(s["usage"]["completion_tokens"] for s in run["sent"].values()) \
        == N * OUT
    sp = rep["speculative"]
    assert (sp["drafts"], sp["accepted"], sp["request_output_tokens"]) == (run["drafts"], run["accepted"], N * OUT)
    assert any(line.startswith("speculative decoding:") for line in rep["headline"])
