"""`kvtrace whatif` on a hybrid model predicts another KV cache size, checked against a real run
at that size (`make test-long`: two servers).

The shared-prefix workload of tests/vllm/test_hybrid.py (system_prompts), here 32 requests over
8 system prompts of 320 tokens round robin, so that between two uses of a prompt the others
allocate more than 100 blocks, is recorded on a fresh server with a 100-block pool; whatif
predicts its hit rate with 300 blocks; then a fresh server with 300 blocks runs it.  The
prediction must be within 2 points of vLLM's own hit rate (its responses' cached tokens)."""
from __future__ import annotations

import json

import pytest

from tests.vllm.conftest import prefix_caching, served
from tests.vllm.test_hybrid import BS, system_prompts, whatif

pytestmark = [pytest.mark.root, pytest.mark.long]
SMALL, LARGE = 100, 300


def serve(base, blocks: int) -> dict:
    args = prefix_caching("--num-gpu-blocks-override", str(blocks), block=BS, max_len=1024)
    with served(base / f"pool{blocks}", args, ports=(8350, 8399), model="hybrid") as srv:
        return system_prompts(srv, base / f"ds{blocks}", n=32, prefixes=8)


def test_whatif_predicts_a_larger_pool(tmp_path, kvtrace_cli):
    small = serve(tmp_path, SMALL)
    wi = whatif(small["ds"], kvtrace_cli, "--cache-blocks", f"{SMALL},{LARGE}")
    pred = {p["cache_blocks"]: p for p in wi["predictions"]}
    large = serve(tmp_path, LARGE)
    print(json.dumps({"recorded": small["hit_rate"], "replayed": pred[SMALL]["hit_rate"],
                      "predicted": pred[LARGE]["hit_rate"], "measured": large["hit_rate"]}))
    assert abs(pred[SMALL]["hit_rate"] - small["hit_rate"]) <= 0.02
    assert abs(large["hit_rate"] - small["hit_rate"]) > 0.02, "the sizes should differ in hit rate"
    assert abs(pred[LARGE]["hit_rate"] - large["hit_rate"]) <= 0.02
