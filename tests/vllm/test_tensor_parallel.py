"""kvtrace attached to vLLM with tensor parallelism (`--tensor-parallel-size 2`: two Worker
processes, each with half the KV heads) and kvtrace's file connector storing a shard per rank,
checked against vLLM's responses and /metrics and the files on disk.

Workload (as tests/vllm/test_example_connector.py): prompts A and B (704 tokens) sent once,
vLLM's prefix cache emptied (/reset_prefix_cache), sent again: the second time every full block
but the last comes back from the files (external tokens), each rank reading its own shard.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.demo.server import TINY_LLAMA
from tests.vllm.conftest import prefix_caching, served
from tests.vllm.test_example_connector import scenario as two_rounds

pytestmark = pytest.mark.root

BLOCK, PROMPT, TP = 32, 704, 2
M = TINY_LLAMA
# one rank's share of a block: K and V of every layer for half the KV heads, bf16
RANK_BLOCK_BYTES = (2 * M["num_hidden_layers"] * BLOCK * (M["num_key_value_heads"] // TP)
                    * (M["hidden_size"] // M["num_attention_heads"]) * 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("tensor-parallel")
    store = base / "kv"
    cfg = {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
           "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
           "kv_connector_extra_config": {"path": str(store)}}
    args = prefix_caching("--num-gpu-blocks-override", "122", "--tensor-parallel-size", str(TP),
                          "--kv-transfer-config", json.dumps(cfg), block=BLOCK)
    with served(base, args, env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                timeout=900) as srv:
        yield scenario(srv, base, store)


def scenario(srv, base: Path, store: Path) -> dict:
    """test_example_connector's two rounds, and the server's Worker processes."""
    return {**two_rounds(srv, base, store), "workers": srv.processes()["workers"]}


def name(r: dict) -> str:
    return r["request"].split("-")[1]


def test_hits_and_each_ranks_shards(run):
    """Per request, local + external = vLLM's cached tokens; the external part sums to vLLM's
    counter.  Each rank stored its own shard of every block: two files per block, each one
    rank's bytes; a load's bytes are its blocks x both ranks' shares."""
    ds, sent = run["ds"], run["sent"]
    assert not ds.problems, ds.problems
    admits = {name(a): a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    cached = {n: r["usage"]["prompt_tokens_details"]["cached_tokens"] for n, r in sent.items()}
    assert {n: a["cached_local"] + a["cached_external"] for n, a in admits.items()} == cached
    assert sum(a["cached_external"] for a in admits.values()) == run["external"] == 2 * BLOCK * ((PROMPT - 1) // BLOCK)
    files = [p for p in run["store"].iterdir() if not p.name.startswith(".") and p.name != "layout.json"]
    by_rank = {r: [p for p in files if p.name.endswith(f".tp{r}")] for r in range(TP)}
    assert len(by_rank[0]) == len(by_rank[1]) == len(files) // TP == 2 * (PROMPT // BLOCK)
    assert {p.stat().st_size for p in files} == {RANK_BLOCK_BYTES}
    assert {p.name.rsplit(".", 1)[0] for p in by_rank[0]} == {p.name.rsplit(".", 1)[0] for p in by_rank[1]}
    for a in ds.table("kv_alloc").to_pylist():
        assert a["connector"] == "KvtraceFileConnector" and a["nbytes"] == a["blocks"] * RANK_BLOCK_BYTES * TP


def test_each_rank_loads_its_shard_and_the_step_waits_for_the_slowest(run):
    """Both Workers' loads are recorded, each of its own blocks' bytes; a step's storage wait is
    the slowest rank's own (the union of its load intervals inside the step, plus its layer
    waits), not the two ranks' added together."""
    ds, workers = run["ds"], set(run["workers"])
    loads = [x for x in ds.table("kv_load").to_pylist() if x["blocks"]]
    assert {x["pid"] for x in loads} == workers and len(workers) == TP
    for pid in workers:
        mine = [x for x in loads if x["pid"] == pid]
        assert sum(x["nbytes"] for x in mine) == sum(x["blocks"] for x in mine) * RANK_BLOCK_BYTES
    steps = {s["step"]: s for s in ds.table("steps").to_pylist()}
    waited = 0
    for step, s in steps.items():
        mine = [x for x in ds.table("kv_load").to_pylist()
                if s["t_sched_end_ns"] <= x["t_start_ns"] <= s["t_end_ns"] and x["pid"] in workers]
        if not mine:
            continue
        per_rank = []
        for pid in workers:
            iv = sorted((max(x["t_start_ns"], s["t_sched_end_ns"]), min(x["t_issue_end_ns"] or x["t_end_ns"], s["t_end_ns"]))
                        for x in mine if x["pid"] == pid)
            union, end = 0, None
            for a, b in iv:
                if end is None or a > end:
                    union += max(b - a, 0)
                    end = b
                elif b > end:
                    union += b - end
                    end = b
            per_rank.append(union + sum(x["wait_ns"] for x in mine if x["pid"] == pid))
        assert s["storage_wait_ns"] == min(max(per_rank), s["t_end_ns"] - s["t_sched_end_ns"]), (step, per_rank)
        waited += 1
    assert waited > 0
