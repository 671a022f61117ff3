"""kvtrace attached to vLLM with vLLM's own ExampleConnector (safetensors files per prompt; a
connector kvtrace knows nothing of), checked against vLLM's responses and /metrics, the files it
wrote and the model's shape.  Chunked prefill off (`--max-num-batched-tokens 2048`): this
connector saves once per forward pass, so a chunked prompt's file would hold its last chunk only.

Workload: prompts A and B (704 tokens each) sent once, vLLM's prefix cache emptied
(/reset_prefix_cache), then sent again: the second time the connector finds each whole prompt
in its files and vLLM loads it (external tokens), from the generic records alone (kv_alloc).
Its stores copy each layer in `save_kv_layer`, during the forward: the worker step's kv_store
spans them, and every write to its files lies inside one.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import TINY_LLAMA
from tests import helpers
from tests.vllm.conftest import prefix_caching, served
from tests.vllm.test_hook import settled_metrics

pytestmark = pytest.mark.root

BLOCK, PROMPT = 32, 704
EXTERNAL = "vllm:external_prefix_cache_hits_total"
M = TINY_LLAMA
# one block's K and V in every layer, bf16: 2 x layers x block x KV heads x head dim x 2 bytes
BLOCK_BYTES = (2 * M["num_hidden_layers"] * BLOCK * M["num_key_value_heads"]
               * (M["hidden_size"] // M["num_attention_heads"]) * 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("example-connector")
    store = base / "kv"
    cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    args = prefix_caching("--kv-transfer-config", json.dumps(cfg), block=BLOCK, budget=2048)
    with served(base, args, env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        yield scenario(srv, base, store)


def scenario(srv, base: Path, store: Path) -> dict:
    rnd = random.Random(35)
    prompts = {"A": workload.tokens(rnd, PROMPT), "B": workload.tokens(rnd, PROMPT)}
    sent = {}
    with helpers.Attached(srv.port, base / "ds"):
        m0 = settled_metrics(srv, (EXTERNAL,))
        for n, p in prompts.items():
            sent[f"{n}1"] = helpers.post_completion(srv.url, srv.model, p, f"{n}1")
        helpers.dev_post(srv.url, "/reset_prefix_cache")
        for n, p in prompts.items():
            sent[f"{n}2"] = helpers.post_completion(srv.url, srv.model, p, f"{n}2")
        m1 = settled_metrics(srv, (EXTERNAL,))
        time.sleep(1.5)
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "external": m1[EXTERNAL] - m0[EXTERNAL], "store": store}


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_its_loads_from_vllms_scheduler_alone(run):
    ds, sent = run["ds"], run["sent"]
    assert not ds.problems, ds.problems
    assert [cached(sent[n]) for n in ("A1", "B1")] == [0, 0] and all(cached(sent[n]) > 0 for n in ("A2", "B2"))
    name = lambda r: r["request"].split("-")[1]   # noqa: E731
    admits = {name(a): a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    assert {n: a["cached_local"] + a["cached_external"] for n, a in admits.items()} == {n: cached(r) for n, r in sent.items()}
    assert sum(a["cached_external"] for a in admits.values()) == run["external"] > 0
    allocs = {name(a): a for a in ds.table("kv_alloc").to_pylist()}
    assert set(allocs) == {"A2", "B2"}
    for n, a in allocs.items():
        assert (a["connector"], a["async"], a["first"], a["external"]) == \
            ("ExampleConnector", 0, 0, admits[n]["cached_external"])
        assert a["blocks"] == -(-a["external"] // BLOCK) and a["nbytes"] == a["blocks"] * BLOCK_BYTES


def test_its_stores_span_save_kv_layer_and_hold_its_writes(run):
    ds = run["ds"]
    stores = [s for s in ds.table("kv_store").to_pylist() if s["source"] == "connector:ExampleConnector"]
    saving = [s for s in stores if s["layer_waits"]]
    # one save_kv_layer per layer per forward that saved: A1 and B1 (the second round loads)
    assert saving and {s["layer_waits"] for s in saving} == {M["num_hidden_layers"]}
    assert all(0 < s["wait_ns"] <= s["t_end_ns"] - s["t_start_ns"] for s in saving)
    writes = [r for r in ds.table("file_io").to_pylist() if (r["path"] or "").startswith(str(run["store"]) + "/")
              and r["syscall"].startswith(("write", "pwrite")) and r["ret"] > 0]
    assert writes
    assert all(any(s["t_start_ns"] <= w["start_ns"] <= s["t_end_ns"] for s in saving) for w in writes)
    # (its files on disk, all written while kvtrace watched)
    on_disk = sum(p.stat().st_size for p in run["store"].rglob("*") if p.is_file())
    assert sum(w["ret"] * (w["weight"] or 1) for w in writes) == on_disk


def test_its_loads_read_its_files_through_mmap(run):
    """The connector loads with safetensors, which maps each file and copies its tensors out: no
    read system call for their bytes.  kvtrace sees the loads as the engine's page faults on
    each file (file_map rows: the faults and their fault-around), from its first page (the
    header) on.  The pages they name are a lower bound: the kernel maps a large folio whole on a
    fault while the fault-around row names its window only (docs/schema.md, file_map)."""
    import os

    ds = run["ds"]
    rows = ds.table("file_map").to_pylist()
    pids = {r["pid"] for r in ds.table("hook_start").to_pylist()}
    files = [p for p in run["store"].rglob("*.safetensors") if p.is_file()]
    assert files
    for p in files:
        st = p.stat()
        mine = [r for r in rows if (r["ino"], r["dev_major"], r["dev_minor"]) == (st.st_ino, os.major(st.st_dev),
                                                                                  os.minor(st.st_dev))
                and r["op"] in ("fault", "map")]
        assert mine and {r["pid"] for r in mine} <= pids, (p, mine[:3])
        pages = {q for r in mine for q in range(r["first_page"], r["first_page"] + r["pages"])}
        assert 0 in pages and pages <= set(range(-(-st.st_size // 4096))), (p, len(pages), st.st_size)
