"""A prefill/decode pair joined by vLLM's NixlConnector (UCX over TCP, CPU buffers), traced by two
agents as two hosts' agents would (KVTRACE_HOST prefill-host and decode-host, one dataset), the
decode host's clock then put 42.5 s ahead: its run's clock_offset_ns (wall - monotonic, read by
its agent at start) is the one place a host's wall clock enters the rows kvtrace places on one
timeline, and it is rewritten as a host 42.5 s off would have recorded it.  (libfaketime in the
agent's process was tried: it makes a sleep interrupted by a signal fail with EINVAL.)
- the connector's scheduler side as kvtrace records it, from the generic connector records alone
  (docs/hook.md, records 21-24), checked against the decode server's own counters
  (`vllm:external_prefix_cache_hits_total`, `vllm:nixl_bytes_transferred_sum`);
- each request's two sides paired (kvtrace.correlate.pd), the skew recovered within the stated
  bound, TTFT's parts summing to TTFT and bounded by the client's measured TTFT;
- one OTLP trace per request across both servers (`kvtrace export`).

Workload: 6 token-id prompts of 700 tokens, 3 sent as vLLM's toy proxy does: to the prefill
server with `do_remote_decode` and 1 output token, then to the decode server with the
kv_transfer_params the prefill server returned; 3 through vllm-router in its prefill/decode mode.  The decode server pulls every prompt block but
all 22 of its blocks (700 = 21 x 32 + 28, the partial last one too) from the prefill server's
KV cache.  vLLM 0.32 names the connector's scheduler class NixlPullConnector.

Marked long (`make test-long`): the pair takes about 2 minutes to start on 2 cores, and a decode
request has been seen to wait up to the prefill server's lease (120 s here) for its pull on this VM.
Set-up: `bash scripts/setup-nixl` (nixl 1.5.1 in a venv beside vLLM's), `bash scripts/setup-router`.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from kvtrace.analysis.report import analyze
from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import TINY_LLAMA, VllmServer, write_tiny_model
from tests.fleet.router import ROUTER, Router
from tests.helpers import Attached, post_completion
from tests.vllm.conftest import free_port, vllm_skip_reason

pytestmark = [pytest.mark.root, pytest.mark.long]

VENV = os.environ.get("KVTRACE_NIXL_VENV", "/var/cache/kvtrace/nixl-venv")
BLOCK, PROMPT, DIRECT, N = 32, 700, 3, 6
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
    if not os.path.exists(ROUTER):
        pytest.skip(f"no vllm-router at {ROUTER}: run bash scripts/setup-router")
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


SKEW = 42.5


def scenario(p: VllmServer, d: VllmServer, base: Path) -> dict:
    """Requests 0-2 are sent as vLLM's toy proxy sends them: to the prefill server, then to the
    decode server; 0 and 2 with their own ids on each side (paired by prompt), 1 with one id on
    both (as a proxy's X-Request-Id).  Requests 3-5 go through a real router in front of the pair
    (vllm-router 0.1.17 --vllm-pd-disaggregation --kv-connector nixl), which picks the ids.  The
    client's TTFT: from sending (to the prefill server, or the router) to the answer of one token."""
    rnd = random.Random(37)
    rows = []
    root = base / "ds"
    with Attached(p.port, root, env={"KVTRACE_HOST": "prefill-host"}), Attached(d.port, root, "--uprobe", "ucx", env={"KVTRACE_HOST": "decode-host"}):
        router = Router(base, [], "round_robin", pd=(p, d))
        try:
            for i in range(N):
                rows.append(one(p, d, router if i >= DIRECT else None, workload.tokens(rnd, PROMPT), i))
        finally:
            router.stop()
        time.sleep(1.5)
    skew(root, "decode-host", int(SKEW * 1e9))
    r = subprocess.run([sys.executable, "-m", "kvtrace", "correlate", str(root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ds = Dataset.open(root)
    expired = set(re.findall(r"Releasing expired KV blocks for request (\S+) ", p.log_path.read_text(errors="replace")))
    live = streamed(p, d, base, rnd)
    return {"live": live, "expired": expired, "p": Hosted(ds, "prefill-host"), "d": Hosted(ds, "decode-host"), "ds": ds, "root": root, "rows": rows}


def streamed(p: VllmServer, d: VllmServer, base: Path, rnd) -> dict:
    """Then one agent traces both servers and streams spans over OTLP (attach --otlp) while two
    more requests go through the pair."""
    from tests.otlp_receiver import Receiver

    with Receiver() as rx:
        with Attached([p.port, d.port], base / "one", "--otlp", rx.url("grpc"), engines=2):
            for i in range(2):
                one(p, d, None, workload.tokens(rnd, PROMPT), 10 + i)
            time.sleep(5)
        spans = list(rx.got.spans)
    return {"spans": spans, "ds": Dataset.open(base / "one")}


def one(p: VllmServer, d: VllmServer, router, prompt: list[int], i: int) -> dict:
    e0, b0 = counter(d, EXTERNAL), counter(d, NIXL_BYTES)
    t0 = time.monotonic()
    if router is not None:
        dr = post_completion(router.url, p.model, prompt, f"r{i}", max_tokens=1)
    else:
        pid, did = (f"x{i}", f"x{i}") if i == 1 else (f"p{i}", f"d{i}")
        pr = post_completion(p.url, p.model, prompt, pid, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        dr = post_completion(d.url, d.model, prompt, did, max_tokens=1, kv_transfer_params=pr["kv_transfer_params"])
    ttft = time.monotonic() - t0
    time.sleep(1.5)   # the engine's stats reach /metrics
    return {"d": dr, "ttft": ttft, "external": counter(d, EXTERNAL) - e0, "nixl_bytes": counter(d, NIXL_BYTES) - b0}



def skew(root: Path, host: str, ns: int) -> None:
    """The host's runs rows as its agent would have written them with its wall clock ns ahead."""
    import pyarrow.parquet as pq

    for f in (root / "runs" / f"host={host}").rglob("*.parquet"):
        t = pq.read_table(f)
        i = t.schema.get_field_index("clock_offset_ns")
        col = [v + ns for v in t.column(i).to_pylist()]
        pq.write_table(t.set_column(i, t.schema.field(i), pa.array(col, t.schema.field(i).type)), f)


class Hosted:
    """One host's partition of the dataset, read as a dataset of its own."""

    def __init__(self, ds: Dataset, host: str):
        self.ds, self.host = ds, host

    def table(self, name: str):
        return self.ds.table(name, host=self.host)


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
    later step, which may come after the prefill server's notice).  A hold the prefill server
    ended itself when its lease ran out (its log: "Releasing expired KV blocks for request X"; seen
    when the decode server's pull came late on a loaded VM) has no notice; nor may the last
    request's, as an idle prefill server runs no step to report it until its next request."""
    ds = run["p"]
    fin = {x["request"]: x for x in ds.table("kv_finish").to_pylist() if x["connector"] == "NixlPullConnector"}
    assert len(fin) == N and all(x["delay_free"] == 1 and x["blocks"] == -(-PROMPT // BLOCK) and
                                 x["nbytes"] == x["blocks"] * BLOCK_BYTES for x in fin.values())
    sent = {x["request"]: x for x in ds.table("kv_done").to_pylist() if x["direction"] == "store"}
    last = max(fin, key=lambda r: fin[r]["t_ns"])
    assert set(sent) <= set(fin) and not set(sent) & run["expired"]
    assert set(sent) | run["expired"] | {last} == set(fin), (sorted(fin), sorted(sent), run["expired"])
    assert len(sent) >= N // 2 and all(sent[r]["t_ns"] > fin[r]["t_ns"] and sent[r]["ok"] for r in sent)
    granted = {x["request"]: x["t_ns"] for x in run["d"].table("kv_alloc").to_pylist()}
    decode_of = {h["p_request"]: h["d_request"] for h in handovers(run)}
    for r, x in sent.items():
        assert x["t_ns"] > granted[decode_of[r]], (r, x["t_ns"], granted)


def handovers(run) -> list[dict]:
    return sorted(run["ds"].table("handovers").to_pylist(), key=lambda h: h["p_arrival_ns"])


def test_each_request_is_joined_across_the_two_hosts(run):
    """Every request's two sides paired: request 1 by its shared id, 0 and 2 by their prompt; the
    KV handed over as each side counted it: the prefill server's blocks and bytes = the decode
    server's = the prompt's blocks x the model's bytes per block = what NIXL says it moved = the
    bytes of the UCX reads the decode server's worker posted in the pull (`--uprobe ucx`)."""
    hs = handovers(run)
    assert [(name({"request": h["p_request"]}), name({"request": h["d_request"]}), h["how"]) for h in hs[:DIRECT]] == [
        ("p0", "d0", "prompt"), ("x1", "x1", "request id"), ("p2", "d2", "prompt")]
    assert len(hs) == N and len({h["d_request"] for h in hs}) == len({h["p_request"] for h in hs}) == N
    assert {(h["p_host"], h["host"]) for h in hs} == {("prefill-host", "decode-host")}
    blocks = -(-PROMPT // BLOCK)
    for h, r in zip(hs, run["rows"]):
        assert (h["p_blocks"], h["d_blocks"]) == (blocks, blocks)
        assert h["p_bytes"] == h["d_bytes"] == blocks * BLOCK_BYTES == r["nixl_bytes"], (h, r)
        # through the transport: the decode worker's ucp_get_nbx calls in its pull (uprobes)
        assert h["d_transport_calls"] >= 1 and h["d_transport_bytes"] == h["d_bytes"], h


def test_the_skewed_clock_is_recovered_within_its_bound(run):
    """The decode host's agent ran 42.5 s ahead: the shift kvtrace estimates from the requests
    that cross the hosts is within its stated error bound of 42.5 s, and the bound is tight (the
    pair's gaps: the proxy's hop and the pull's notice, well under a second here)."""
    (shift,) = {h["clock_shift_ns"] for h in handovers(run)}
    (err,) = {h["clock_error_ns"] for h in handovers(run)}
    assert err is not None and 0 <= err < 1e9, err
    assert abs(shift - SKEW * 1e9) <= err, (shift, err)
    rep = analyze(run["root"])
    assert rep["handover"]["clocks"][0]["error_s"] == pytest.approx(err / 1e9, abs=1e-6) and rep["handover"]["pairs"] == N


def test_ttft_parts_sum_to_ttft_and_the_client_saw_at_least_it(run):
    """TTFT (the prefill server's arrival to the decode server's first token, on one timeline)
    = queue + prefill + handoff + pull + first decode, each part not negative beyond the clock
    bound; it equals the requests rows of each side; the client, which sent to the prefill server
    before vLLM's arrival stamp and got the answer after the first token, saw at least it (less
    the clock bound); sending directly, at most a second more (its HTTP round trips).  Through
    the router no upper bound: its own time before and after the servers (1.4 s once here) is
    outside both servers."""
    hs, rows = handovers(run), run["rows"]
    req = {(x["host"], x["request"]): x for x in run["ds"].table("requests").to_pylist()}
    for h, r in zip(hs, rows):
        parts = [h[k] for k in ("queue_ns", "prefill_ns", "handoff_ns", "pull_ns", "first_decode_ns")]
        err = h["clock_error_ns"]
        assert sum(parts) == h["ttft_ns"] and all(p >= -err for p in parts), (parts, err)
        pq, dq = req[("prefill-host", h["p_request"])], req[("decode-host", h["d_request"])]
        assert h["prefill_ns"] == pq["prefill_end_ns"] - pq["first_scheduled_ns"]
        assert h["first_decode_ns"] + h["pull_ns"] == dq["prefill_end_ns"] - dq["arrival_ns"]
        client = int(r["ttft"] * 1e9)
        assert h["ttft_ns"] - err <= client, (h["ttft_ns"], client, err)
        if h["how"] == "prompt" or h["p_request"].startswith("cmpl-x"):   # sent directly, not by the router
            assert client <= h["ttft_ns"] + err + 1_000_000_000, (h["ttft_ns"], client, err)


def test_one_otlp_trace_spans_both_servers(run):
    """`kvtrace export`: each decode request's span is in its prefill request's trace, a child of
    the prefill request's span; the decode side's requests rows say so (joined_trace)."""
    from tests.otlp_receiver import Receiver

    with Receiver() as rx:
        r = subprocess.run([sys.executable, "-m", "kvtrace", "export", str(run["root"]), "--otlp", rx.url("grpc")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        spans = list(rx.got.spans)
    reqs = {s.attrs.get("kvtrace.request.id"): s for s in spans if s.name == "kvtrace.request"}
    for h in handovers(run):
        p, d = reqs[h["p_request"]], reqs[h["d_request"]]
        assert d.trace_id == p.trace_id and d.parent_id == p.span_id, (p, d)
        assert {s.trace_id for s in spans if s.attrs.get("kvtrace.request.id") == h["d_request"]} == {p.trace_id}
    dq = {x["request"]: x for x in run["d"].table("requests").to_pylist()}
    assert all(dq[h["d_request"]]["joined_trace"] for h in handovers(run))


def test_streamed_live_one_trace_spans_both_servers(run):
    """attach --port P --port D --otlp: each decode request's spans, as streamed while attached,
    are in its prefill request's trace, its request span a child of the prefill request's."""
    live = run["live"]
    hs = live["ds"].table("handovers").to_pylist()
    assert len(hs) == 2 and {h["clock_error_ns"] for h in hs} == {0}
    reqs = {s.attrs.get("kvtrace.request.id"): s for s in live["spans"] if s.name == "kvtrace.request"}
    for h in hs:
        p, d = reqs[h["p_request"]], reqs[h["d_request"]]
        assert d.trace_id == p.trace_id and d.parent_id == p.span_id, (p, d)
        chunks = [s for s in live["spans"] if s.name == "kvtrace.prefill_chunk" and s.attrs.get("kvtrace.request.id") == h["d_request"]]
        assert chunks and {s.trace_id for s in chunks} == {p.trace_id}
