"""OTLP traces of a capture against a real vLLM CPU server (tiny random-weight Llama, token-id
prompts, the file KV connector), checked against a real OTLP receiver (tests/otlp_receiver.py),
against the Parquet dataset of the same capture, and against vLLM's own ``llm_request`` spans.

vLLM runs with ``--otlp-traces-endpoint`` pointing at the receiver and every request carries a
W3C ``traceparent``: vLLM's span and kvtrace's spans of a request must land in one trace.
"""
from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvtrace.demo.server import TINY_LLAMA, VllmServer

from tests.helpers import free_port, post_completion, wait_for
from tests.otlp_receiver import Receiver

from .conftest import vllm_skip_reason

pytestmark = pytest.mark.root
REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
FULL = 31  # full blocks of a 1000-token prompt that can come from the connector (never the last token)
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
BLOCK_BYTES = TINY_LLAMA["num_hidden_layers"] * 2 * TINY_LLAMA["num_key_value_heads"] * BLOCK * HEAD_DIM * 2


def post(server, prompt, name, traceparent, max_tokens=4, **extra):
    return post_completion(server.url, server.model, prompt, name, max_tokens, headers={"traceparent": traceparent},
                           **extra)


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("otlp")
    rx = Receiver().start()
    cfg = {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
           "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
           "kv_connector_extra_config": {"path": str(base / "blocks")}}
    server = VllmServer(args=["--block-size", str(BLOCK), "--enable-prefix-caching", "--max-num-batched-tokens", "256",
                              "--kv-cache-memory-bytes", "8000000", "--num-gpu-blocks-override", "122", "--max-model-len", "2048",
                              "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(cfg),
                              "--otlp-traces-endpoint", rx.grpc_url],
                        env={"OTEL_BSP_SCHEDULE_DELAY": "500"},
                        port=free_port(8400, 8499), workdir=base / "server")
    try:
        server.start(timeout=600)
        yield run_capture(server, rx, base)
    finally:
        server.stop()
        rx.stop()


def run_capture(server, rx, base) -> dict:
    procs = server.processes()
    out = base / "ds"
    cmd = [sys.executable, "-m", "kvtrace", "attach", "--out", str(out), "--quiet", "--otlp", rx.grpc_url]
    for p in procs["engine"] + procs["workers"]:
        cmd += ["--pid", str(p)]
    err = base / "agent.stderr"
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(err, "wb"), cwd=REPO)
    rnd = random.Random(4242)
    tok = lambda n: [rnd.randrange(3, 32000) for _ in range(n)]  # noqa: E731
    sent: dict[str, dict] = {}
    try:
        wait_for(lambda: agent.poll() is not None or "attached" in err.read_text(errors="replace"), 180, "attach")
        assert agent.poll() is None, err.read_text()[-3000:]
        time.sleep(2.5)  # the hook re-reads the agent flag at most once a second

        def send(name, prompt, **kw):
            tp = f"00-{rnd.getrandbits(128):032x}-{rnd.getrandbits(64):016x}-01"
            sent[name] = {"traceparent": tp, "prompt_len": len(prompt), "resp": post(server, prompt, name, tp, **kw)}

        A = tok(1000)
        prefix = tok(600)
        send("A1", A)                                # cold: 4 chunks, its 31 full blocks stored to files
        send("S1", prefix + tok(300))                # shared prefix, cold
        send("S2", prefix + tok(200))                # 18 local prefix-cache blocks hit
        for i in range(5):                           # 5 x 32 fresh blocks > 122: A's blocks evicted
            send(f"F{i}", tok(1000), max_tokens=1)
        send("A2", A)                                # 31 blocks loaded from the files
        time.sleep(7)                                # > lateness + a pass's period: everything final while attached
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)
        rc = agent.wait(180)
    assert rc == 0, err.read_text()[-3000:]
    # vLLM's own account of each request, kept beside the dataset (tests/data/vllm-otlp-capture is one)
    (base / "vllm_usage.json").write_text(json.dumps(
        {n: {"prompt_tokens": v["resp"]["usage"]["prompt_tokens"],
             "cached_tokens": v["resp"]["usage"]["prompt_tokens_details"]["cached_tokens"],
             "traceparent": v["traceparent"]} for n, v in sent.items()}, indent=1))
    ids = {f"cmpl-{n}-0" for n in sent}
    wait_for(lambda: ids <= {s.attrs.get("gen_ai.request.id") for s in list(rx.got.spans) if s.name == "llm_request"},
             60, "vLLM's llm_request spans")
    live = [s for s in list(rx.got.spans) if s.resource.get("service.name") == "kvtrace"]
    vllm = [s for s in list(rx.got.spans) if s.name == "llm_request"]
    return {"server": server, "rx": rx, "out": out, "sent": sent, "live": live, "vllm": vllm,
            "stderr": err.read_text(errors="replace")}


def by_name(spans):
    out = collections.defaultdict(list)
    for s in spans:
        out[s.name].append(s)
    return out


def test_every_request_is_one_trace_with_its_chunks(capture):
    c = capture
    live, out = c["live"], c["out"]
    reqs = pq.read_table(out / "requests").to_pylist()
    chunks = pq.read_table(out / "chunks").to_pylist()
    raw_chunks = pq.read_table(out / "chunk").to_pylist()
    names = by_name(live)
    ext = {f"cmpl-{n}-0" for n in c["sent"]}
    assert {r["external_id"] for r in reqs} == ext
    # span counts equal the request and chunk counts (derived table and the hook's raw records)
    assert len(names["kvtrace.request"]) == len(reqs) == len(c["sent"]) == 9
    assert len(names["kvtrace.prefill_chunk"]) == len(chunks) == len(raw_chunks)
    spans = {s.span_id: s for s in live}
    assert len(spans) == len(live), "a span id repeats"
    traces = collections.defaultdict(list)
    for s in live:
        traces[s.trace_id].append(s)
    assert len(traces) == len(reqs)
    for tid, ss in traces.items():
        (root,) = [s for s in ss if s.name == "kvtrace.request"]
        for s in ss:
            if s is root:
                continue
            parent = spans[s.parent_id]
            assert parent.trace_id == tid
            assert parent.start <= s.start and s.end <= parent.end, (s.name, parent.name)
            if s.name == "kvtrace.prefill_chunk":
                assert parent is root
    # attribute values equal the Parquet dataset's
    crow = {r["span_id"]: r for r in chunks}
    for s in names["kvtrace.prefill_chunk"]:
        r = crow[s.span_id]
        for col, attr in (("chunk_index", "index"), ("attempt", "attempt"), ("token_start", "token_start"),
                          ("token_end", "token_end"), ("cached_tokens", "cached_tokens"), ("hit_blocks", "hit_blocks"),
                          ("evicted_blocks", "evicted_blocks"), ("load_bytes", "load_bytes"),
                          ("storage_wait_ns", "storage_wait_ns"), ("compute_ns", "compute_ns"), ("bottleneck", "bottleneck")):
            assert s.attrs[f"kvtrace.chunk.{attr}"] == r[col], (col, s.attrs, r)
    rrow = {r["span_id"]: r for r in reqs}
    for s in names["kvtrace.request"]:
        r = rrow[s.span_id]
        assert s.attrs["gen_ai.request.id"] == r["external_id"]
        assert (s.attrs["kvtrace.request.cached_tokens"], s.attrs["kvtrace.request.chunks"]) == (r["cached_tokens"], r["chunks"])


def test_numbers_match_vllm(capture):
    """Per request: cached tokens = vLLM's usage.prompt_tokens_details.cached_tokens; chunks tile
    the prompt from the cached prefix in 256-token steps; A2's 31 blocks come from the files."""
    c = capture
    reqs = {r["external_id"]: r for r in pq.read_table(c["out"] / "requests").to_pylist()}
    chunks = collections.defaultdict(list)
    for r in pq.read_table(c["out"] / "chunks").to_pylist():
        chunks[r["request"]].append(r)
    for name, s in c["sent"].items():
        r = reqs[f"cmpl-{name}-0"]
        usage = s["resp"]["usage"]
        assert r["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"], name
        assert r["prompt_len"] == usage["prompt_tokens"] == s["prompt_len"]
        cs = sorted(chunks[r["request"]], key=lambda x: x["step"])
        assert cs[0]["token_start"] == r["cached_tokens"] and cs[-1]["token_end"] == r["prompt_len"]
        assert all(a["token_end"] == b["token_start"] for a, b in zip(cs, cs[1:]))
        assert all(x["tokens"] <= 256 for x in cs) and r["finished"]
    assert reqs["cmpl-A2-0"]["cached_external"] == FULL * BLOCK == 992
    assert reqs["cmpl-S2-0"]["cached_local"] == 600 // BLOCK * BLOCK
    a2 = reqs["cmpl-A2-0"]
    assert (a2["load_count"], a2["load_bytes"]) == (1, FULL * BLOCK_BYTES)
    names = by_name([s for s in c["live"] if s.trace_id == a2["trace_id"]])
    (load,) = names["kvtrace.kv_load"]
    assert (load.attrs["kvtrace.transfer.blocks"], load.attrs["kvtrace.transfer.bytes"]) == (FULL, FULL * BLOCK_BYTES)
    # the kernel saw the worker's reads of the 31 block files inside that load, on its thread
    (fio,) = names["kvtrace.file_io"]
    assert fio.parent_id == load.span_id
    assert (fio.attrs["kvtrace.io.files"], fio.attrs["kvtrace.io.bytes"]) == (FULL, FULL * BLOCK_BYTES)
    chunk0 = next(s for s in names["kvtrace.prefill_chunk"] if s.attrs["kvtrace.chunk.index"] == 0)
    assert load.parent_id == chunk0.span_id and chunk0.attrs["kvtrace.chunk.storage_wait_ns"] > 0
    evicted = sum(r["evicted_blocks"] for r in reqs.values())
    assert evicted > 0 and evicted == sum(s.attrs["kvtrace.chunk.evicted_blocks"] for s in by_name(c["live"])["kvtrace.prefill_chunk"])
    kinds = {k: len(v) for k, v in by_name(c["live"]).items()}
    print("kvtrace otlp check:", json.dumps({
        "requests": len(reqs), "spans": kinds, "evicted_blocks": evicted, "llm_request_spans": len(c["vllm"]),
        "A2": {k: a2[k] for k in ("cached_tokens", "cached_external", "load_count", "load_bytes", "load_ns",
                                  "storage_wait_ns", "chunks")},
        "A2_file_reads": {k: fio.attrs[k] for k in ("kvtrace.io.count", "kvtrace.io.files", "kvtrace.io.bytes")},
        "cached": {n: reqs[f"cmpl-{n}-0"]["cached_tokens"] for n in c["sent"]}}))


def test_kvtrace_spans_join_vllms_trace(capture):
    c = capture
    vllm = {s.attrs["gen_ai.request.id"]: s for s in c["vllm"]}
    live = c["live"]
    for name, s in c["sent"].items():
        _, trace, parent, _ = s["traceparent"].split("-")
        v = vllm[f"cmpl-{name}-0"]
        assert (v.trace_id, v.parent_id) == (trace, parent), name
        mine = [x for x in live if x.trace_id == trace]
        names = by_name(mine)
        (req,) = names["kvtrace.request"]
        assert req.parent_id == parent and req.attrs["kvtrace.trace.joined"] is True
        assert names["kvtrace.prefill_chunk"] and all(x.trace_id == v.trace_id for x in names["kvtrace.prefill_chunk"])
        # kvtrace's request span lies within vLLM's llm_request span (arrival -> finish), give or take the step
        assert req.start >= v.start - 5_000_000 and req.end <= v.end + 50_000_000, (name, req.start - v.start, req.end - v.end)


def test_export_of_the_dataset_sends_the_same_spans(capture, kvtrace_cli):
    c = capture
    with Receiver() as rx2:
        r = kvtrace_cli("export", str(c["out"]), "--otlp", rx2.http_url, "--otlp-protocol", "http", timeout=300)
        assert r.returncode == 0, r.stderr
        exported = sorted(s.key() for s in rx2.got.spans)
    assert exported == sorted(s.key() for s in c["live"])


def test_dataset_reads_back_in_duckdb_and_pandas(capture):
    import duckdb
    import pandas as pd

    from kvtrace.dataset import schema

    out = capture["out"]
    for name in ("requests", "chunks", "steps", "attributions", "chunk", "kv_load", "file_io"):
        df = pd.read_parquet(out / name)
        got = duckdb.connect().execute(
            f"select * from read_parquet('{out}/{name}/*/*/*.parquet', hive_partitioning=true)").df()
        assert len(df) == len(got) > 0, name
        if name in schema.TABLES:
            assert list(df.columns)[1:1 + len(schema.TABLES[name])] == [f.name for f in schema.TABLES[name]], name
    n = duckdb.connect().execute(
        f"select count(*) from read_parquet('{out}/chunks/*/*/*.parquet') where bottleneck in "
        "('storage', 'compute', 'scheduler', 'recompute')").fetchone()[0]
    assert n == len(pd.read_parquet(out / "chunks"))


def test_run_row_reports_the_sink(capture):
    runs = pq.read_table(c_out := capture["out"] / "runs").to_pylist()
    (sink,) = json.loads(runs[-1]["sinks"])
    assert sink["sent"] == sink["spans_built"] == len(capture["live"]) and sink["dropped"] == 0, sink
    assert sink["correlation_errors"] == 0 and sink["metrics_sent"] > 0
    assert "otlp grpc" in capture["stderr"] and c_out.exists()
