"""`kvtrace whatif` on a hybrid model predicts another KV cache size, checked against a real run
at that size (`make test-long`: two servers).

The shared-prefix workload of tests/vllm/test_hybrid.py (system_prompts: 24 requests, 4 system
prompts of 320 tokens round robin) is recorded on a fresh server with a 100-block pool; whatif
predicts its hit rate with 200 blocks; then a fresh server with 200 blocks runs it.  The
prediction must be within 2 points of vLLM's own hit rate (its responses' cached tokens)."""
from __future__ import annotations

import json

import pytest

from kvtrace.demo.server import VllmServer
from tests.vllm.conftest import free_port, vllm_skip_reason
from tests.vllm.test_hybrid import BS, system_prompts, whatif

pytestmark = [pytest.mark.root, pytest.mark.long]
SMALL, LARGE = 100, 200


def serve(base, blocks: int) -> dict:
    srv = VllmServer(args=["--block-size", str(BS), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                           "--max-num-batched-tokens", "256", "--max-model-len", "1024",
                           "--num-gpu-blocks-override", str(blocks)],
                     port=free_port(8350, 8399), env={"VLLM_PLUGINS": ""}, workdir=base / f"server{blocks}",
                     model_name="hybrid")
    srv.start(timeout=600)
    try:
        return system_prompts(srv, base / f"ds{blocks}")
    finally:
        srv.stop()


def test_whatif_predicts_a_larger_pool(tmp_path, kvtrace_cli):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    small = serve(tmp_path, SMALL)
    wi = whatif(small["ds"], kvtrace_cli, "--cache-blocks", f"{SMALL},{LARGE}")
    pred = {p["cache_blocks"]: p for p in wi["predictions"]}
    large = serve(tmp_path, LARGE)
    print(json.dumps({"recorded": small["hit_rate"], "replayed": pred[SMALL]["hit_rate"],
                      "predicted": pred[LARGE]["hit_rate"], "measured": large["hit_rate"]}))
    assert abs(pred[SMALL]["hit_rate"] - small["hit_rate"]) <= 0.02
    assert abs(large["hit_rate"] - small["hit_rate"]) > 0.02, "the sizes should differ in hit rate"
    assert abs(pred[LARGE]["hit_rate"] - large["hit_rate"]) <= 0.02
