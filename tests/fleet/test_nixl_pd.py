"""A prefill/decode pair joined by vLLM's NixlConnector (UCX over TCP, CPU buffers), with kvtrace
attached to both servers: the connector's scheduler side as kvtrace records it, from the generic
connector records alone (docs/hook.md, records 21-24), checked against the decode server's own
counters (`vllm:external_prefix_cache_hits_total`, `vllm:nixl_bytes_transferred_sum`).

Workload: 3 token-id prompts of 700 tokens, each sent as vLLM's toy proxy does: to the prefill
server with `do_remote_decode` and 1 output token, then to the decode server with the
kv_transfer_params the prefill server returned.  The decode server pulls every prompt block but
all 22 of its blocks (700 = 21 x 32 + 28, the partial last one too) from the prefill server's
KV cache.  vLLM 0.32 names the connector's scheduler class NixlPullConnector.

Marked long (`make test-long`): the pair takes about 2 minutes to start on 2 cores, and a decode
request has been seen to wait up to the prefill server's lease (120 s here) for its pull on this VM.
Set-up: `bash scripts/setup-nixl` (nixl 1.5.1 in a venv beside vLLM's).
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import TINY_LLAMA, VllmServer, write_tiny_model
from tests.helpers import Attached, post_completion
from tests.vllm.conftest import free_port, vllm_skip_reason

pytestmark = [pytest.mark.root, pytest.mark.long]

VENV = os.environ.get("KVTRACE_NIXL_VENV", "/var/cache/kvtrace/nixl-venv")
BLOCK, PROMPT, N = 32, 700, 3
M = TINY_LLAMA
BLOCK_BYTES = (2 * M["num_hidden_layers"] * BLOCK * M["num_key_value_heads"]
               * (M["hidden_size"] // M["num_attention_heads"]) * 2)
EXTERNAL, NIXL_BYTES = "vllm:external_prefix_cache_hits_total", "vllm:nixl_bytes_transferred_sum"


def server(role: str, core: int, work: Path, model: Path) -> VllmServer:
    """One of the pair.  Both serve the same model directory: NIXL's handshake compares a hash of
    the two servers' configurations, the model's path included."""
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
          "kv_connector_extra_config": {"kv_lease_duration": 120}}
    return VllmServer(args=["--model", str(model), "--block-size", str(BLOCK), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                            "--num-gpu-blocks-override", "128", "--max-model-len", "2048",
                            "--kv-transfer-config", json.dumps(kv)],
                      env={"VLLM_PLUGINS": "", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(5700, 5799)), "UCX_TLS": "tcp,self,sm",
                           "VLLM_CPU_OMP_THREADS_BIND": str(core)},
                      port=free_port(8300, 8399), python=f"{VENV}/bin/python", workdir=work)


def counter(srv: VllmServer, name: str) -> float:
    total = 0.0
    for line in srv.metrics().splitlines():
        if re.match(rf"{re.escape(name)}(\{{| )", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    if not os.path.exists(f"{VENV}/bin/python"):
        pytest.skip(f"no NIXL venv at {VENV}: run bash scripts/setup-nixl")
    base = tmp_path_factory.mktemp("nixl-pd")
    model = write_tiny_model(base / "tiny-llama", TINY_LLAMA)
    p, d = server("kv_producer", 0, base / "prefill", model), server("kv_consumer", 1, base / "decode", model)
    try:
        for s in (p, d):
            s.start(timeout=900)
            s.model = str(model)   # (the last --model wins: the one both serve)
        yield scenario(p, d, base)
    finally:
        d.stop()
        p.stop()


def scenario(p: VllmServer, d: VllmServer, base: Path) -> dict:
    rnd = random.Random(37)
    rows = []
    with Attached(p.port, base / "p-ds"), Attached(d.port, base / "d-ds"):
        for i in range(N):
            prompt = workload.tokens(rnd, PROMPT)
            e0, b0 = counter(d, EXTERNAL), counter(d, NIXL_BYTES)
            pr = post_completion(p.url, p.model, prompt, f"p{i}", max_tokens=1, kv_transfer_params={
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None})
            ktp = pr["kv_transfer_params"]
            dr = post_completion(d.url, d.model, prompt, f"d{i}", max_tokens=4, kv_transfer_params=ktp)
            time.sleep(1.5)   # the engine's stats reach /metrics
            rows.append({"ktp": ktp, "d": dr, "external": counter(d, EXTERNAL) - e0,
                         "nixl_bytes": counter(d, NIXL_BYTES) - b0})
        time.sleep(1.5)
    return {"p": Dataset.open(base / "p-ds"), "d": Dataset.open(base / "d-ds"), "rows": rows}


def name(r: dict) -> str:
    return r["request"].split("-")[1] if "-" in r["request"] else r["request"]


def test_the_decode_servers_pulls_as_its_scheduler_drove_them(run):
    """Per request: vLLM's external hit (its counter) = kvtrace's kv_alloc external tokens = the
    admission's cached_external; an asynchronous load of that many blocks and bytes (blocks x
    the model's KV bytes per block: exactly the bytes NIXL says it moved), done and ok."""
    rows, ds = run["rows"], run["d"]
    assert [r["external"] for r in rows] == [PROMPT] * N, rows
    alloc = sorted(ds.table("kv_alloc").to_pylist(), key=lambda a: a["t_ns"])
    admit = {a["request"]: a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    assert len(alloc) == N and {a["connector"] for a in alloc} == {"NixlPullConnector"}
    for a, r in zip(alloc, rows):
        assert (a["first"], a["external"], a["async"]) == (0, r["external"], 1)
        assert a["blocks"] == -(-PROMPT // BLOCK) and a["nbytes"] == a["blocks"] * BLOCK_BYTES == r["nixl_bytes"]
        assert admit[a["request"]]["cached_external"] == r["external"]
    done = [x for x in ds.table("kv_done").to_pylist() if x["direction"] == "load"]
    assert sorted(x["request"] for x in done) == sorted(a["request"] for a in alloc) and all(x["ok"] for x in done)


def test_the_prefill_server_holds_each_requests_blocks_until_the_pull(run):
    """The prefill server hands each finished request's blocks to the connector and keeps them
    (delay_free) until the decode server has pulled them: a kv_finish with delay_free, then a
    kv_done store for it, which comes after the decode server granted the pull (its kv_alloc:
    both servers' records are on one clock; the decode scheduler learns its load is done at a
    later step, which may come after the prefill server's notice)."""
    ds = run["p"]
    fin = {x["request"]: x for x in ds.table("kv_finish").to_pylist() if x["connector"] == "NixlPullConnector"}
    assert len(fin) == N and all(x["delay_free"] == 1 and x["blocks"] == -(-PROMPT // BLOCK) and
                                 x["nbytes"] == x["blocks"] * BLOCK_BYTES for x in fin.values())
    sent = {x["request"]: x for x in ds.table("kv_done").to_pylist() if x["direction"] == "store"}
    assert set(sent) == set(fin) and all(sent[r]["t_ns"] > fin[r]["t_ns"] and sent[r]["ok"] for r in fin)
    granted = {name(x): x["t_ns"] for x in run["d"].table("kv_alloc").to_pylist()}
    for r, x in sent.items():
        assert x["t_ns"] > granted["d" + name(x)[1:]], (r, x["t_ns"], granted)
