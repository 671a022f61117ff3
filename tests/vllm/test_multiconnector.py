"""kvtrace attached to vLLM with a `MultiConnector` stacking kvtrace's file connector over vLLM's
ExampleConnector, checked against vLLM's responses and /metrics and both connectors' files.

Workload (tests/vllm/test_example_connector.py's two rounds, chunked prefill off for the
ExampleConnector): prompts A and B sent once (both connectors store them), vLLM's prefix cache
emptied, sent again: MultiConnector asks its connectors in order and loads from the first that
has the prefix, the file connector.  Marked long (`make test-long`): the connectors it stacks
each have a live test of their own in CI.
"""
from __future__ import annotations

import json

import pytest

from kvtrace.demo.server import VllmServer
from tests.vllm.conftest import free_port, vllm_skip_reason
from tests.vllm.test_example_connector import BLOCK, BLOCK_BYTES, PROMPT
from tests.vllm.test_example_connector import scenario as two_rounds

pytestmark = [pytest.mark.root, pytest.mark.long]   # by hand (make test-long): CI's time goes to the configurations

NAME = "MultiConnector(KvtraceFileConnector+ExampleConnector)"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("multiconnector")
    files, example = base / "kv-files", base / "kv-example"
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
         "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector", "kv_connector_extra_config": {"path": str(files)}},
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(example)}}]}}
    srv = VllmServer(args=["--block-size", str(BLOCK), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                           "--max-num-batched-tokens", "2048", "--max-model-len", "2048",
                           "--kv-transfer-config", json.dumps(cfg)],
                     port=free_port(8300, 8349), env={"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1"},
                     workdir=base / "server")
    srv.start(timeout=600)
    try:
        yield {**two_rounds(srv, base, files), "example": example}
    finally:
        srv.stop()


def test_the_stack_loads_as_vllms_scheduler_drove_it(run):
    """Per request local + external = vLLM's cached tokens; the external hits sum to vLLM's counter
    and each second-round load names the stack and its connectors, with blocks x block bytes."""
    ds, sent = run["ds"], run["sent"]
    name = lambda r: r["request"].split("-")[1]   # noqa: E731
    admits = {name(a): a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    cached = {n: r["usage"]["prompt_tokens_details"]["cached_tokens"] for n, r in sent.items()}
    assert {n: a["cached_local"] + a["cached_external"] for n, a in admits.items()} == cached
    assert sum(a["cached_external"] for a in admits.values()) == run["external"] == 2 * BLOCK * ((PROMPT - 1) // BLOCK)
    allocs = {name(a): a for a in ds.table("kv_alloc").to_pylist()}
    assert set(allocs) == {"A2", "B2"}
    for n, a in allocs.items():
        assert (a["connector"], a["first"], a["external"]) == (NAME, 0, admits[n]["cached_external"])
        assert a["blocks"] == a["external"] // BLOCK and a["nbytes"] == a["blocks"] * BLOCK_BYTES


def test_both_connectors_stored_and_the_first_served(run):
    """Both stored round 1 (the file connector a file per full block; the ExampleConnector its
    per-prompt files); the loads came from the file connector (its own load rows)."""
    ds = run["ds"]
    blocks = [p for p in run["store"].iterdir() if not p.name.startswith(".") and p.name != "layout.json"]
    assert len(blocks) == 2 * (PROMPT // BLOCK) and {p.stat().st_size for p in blocks} == {BLOCK_BYTES}
    assert any(p.is_file() for p in run["example"].rglob("*.safetensors"))
    loads = [x for x in ds.table("kv_load").to_pylist() if x["blocks"] and x["request"]]
    assert loads and {x["source"] for x in loads} == {"kvtrace-file"}
    assert sum(x["blocks"] for x in loads) == run["external"] // BLOCK
