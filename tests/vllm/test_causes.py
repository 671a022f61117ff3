"""Why each prompt token missed, against a real vLLM server whose workload makes every cause
happen a known number of times, checked against the workload's construction, vLLM's responses
and its BlockStored/BlockRemoved stream; in the dataset, in `kvtrace analyze` and on the OTLP
spans the agent streams while attached.

Blocks of 32 tokens; prompts of 1,000 tokens: 31 full blocks, of which vLLM can hit at most 31
(992 tokens: it computes the last token), and a tail of 8.
  A      a new prompt                                    cold 992, tail 8
  X1,X2  one new 640-token prefix, sent together; chunks of at most 64 tokens
         (--long-prefill-token-threshold): X2 is admitted in the step X1's first chunk runs, hits
         its 2 blocks and misses the 18 X1 is still computing   X2: hit 64, in flight 576, cold 352, tail 8
  S      A's tokens with a cache_salt                    other key 992, tail 8
  F0-F3  new prompts: 128 blocks into a 121-block cache  cold 992, tail 8 each
  A2     A again: its evicted blocks                     hit = vLLM's, evicted = 992 - hit, tail 8
  L      A's tokens with prompt logprobs (no lookup)     not looked up 1,000
  burst  three 1,000-token prompts decoding 1,000 tokens: preemptions, re-admissions tiled too
Then a second attach (the server has served): a new prompt U is unseen 992, tail 8.
"""
from __future__ import annotations

import collections
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtrace.correlate.causes import CAUSES, MISSES
from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer
from tests import helpers
from tests.helpers import wait_for
from tests.otlp_receiver import Receiver
from tests.vllm.conftest import KvEventSink, free_port, vllm_skip_reason
from tests.vllm.test_hook import settled_metrics
from tests.vllm_checks import events

pytestmark = pytest.mark.root

BS, N, TOP, TAIL = 32, 1000, 992, 8
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("zmq")
    zport = free_port(8180, 8199)
    events = KvEventSink(zport).start()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    srv = VllmServer(args=["--block-size", str(BS), "--enable-prefix-caching", "--max-num-batched-tokens", "256",
                           "--long-prefill-token-threshold", "64", "--num-gpu-blocks-override", "122",
                           "--max-model-len", "2048", "--enable-prompt-tokens-details",
                           "--kv-events-config", json.dumps(kv)],
                     port=free_port(8100, 8179, avoid=(zport,)), env={"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1"},
                     workdir=tmp_path_factory.mktemp("causes"))
    srv.start()
    try:
        yield srv, events
    finally:
        srv.stop()
        events.close()


class Attached:
    """`kvtrace attach --port` streaming OTLP to a receiver, until stop()."""

    def __init__(self, srv, out: Path, rx):
        self.err = out.parent / f"{out.name}.stderr"
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(srv.port),
                                      "--out", str(out), "--otlp", rx.grpc_url], stderr=open(self.err, "wb"), cwd=REPO)
        wait_for(lambda: self.proc.poll() is not None or "injected in engine" in self.err.read_text(errors="replace"),
                 180, "the hook's injection")
        assert self.proc.poll() is None, self.err.read_text()[-3000:]
        time.sleep(1.2)   # the hook re-reads the agent flag once a second

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(180) == 0, self.err.read_text()[-3000:]


def post(srv, prompt, name, **kw) -> dict:
    return helpers.post_completion(srv.url, srv.model, prompt, name, max_tokens=kw.pop("max_tokens", 4), **kw)


def together(srv, items: dict[str, tuple[list[int], dict]]) -> dict[str, dict]:
    """Requests queued while the scheduler is paused, so they reach it in one step, in order."""
    out: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda n=n, p=p, kw=kw: out.__setitem__(n, post(srv, p, n, **kw)))
               for n, (p, kw) in items.items()]
    helpers.dev_post(srv.url, "/pause?mode=keep&clear_cache=false")
    try:
        for t in threads:
            t.start()
            time.sleep(0.3)
        time.sleep(1.5)
    finally:
        helpers.dev_post(srv.url, "/resume")
    for t in threads:
        t.join(600)
    return out


def stream_chains(batches, prompts: dict[str, list[int]], nth: dict[str, int] | None = None) -> tuple[dict, list]:
    """From vLLM's own BlockStored events alone: each prompt's chain of block hashes (matched by
    parent hash and token ids; ``nth``: a prompt whose tokens an earlier one stored under another
    key takes the nth chain starting with its first block), and the (recv time, event, hashes)
    of every event in order."""
    by_content, order = {}, []
    for recv, _seq, (_ts, evs, *_r) in batches:
        for ev in events(evs):
            if ev["type"] == "BlockStored":
                parent, toks, size = ev.get("parent_block_hash"), ev["token_ids"], ev["block_size"]
                for i, h in enumerate(ev["block_hashes"]):
                    by_content.setdefault((parent, tuple(toks[i * size:(i + 1) * size])), []).append(h & (2**64 - 1))
                    parent = h
                order.append((recv, "stored", [h & (2**64 - 1) for h in ev["block_hashes"]]))
            elif ev["type"] == "BlockRemoved":
                order.append((recv, "removed", [h & (2**64 - 1) for h in ev["block_hashes"]]))
    chains = {}
    for name, toks in prompts.items():
        parent, chain = None, []
        for i in range(len(toks) // BS):
            hs = list(dict.fromkeys(by_content.get((parent, tuple(toks[i * BS:(i + 1) * BS])), [])))
            k = (nth or {}).get(name, 0) if i == 0 else 0
            if len(hs) <= k:
                break
            chain.append(hs[k])
            parent = hs[k]
        chains[name] = chain
    return chains, order


def quiet(events, still_s: float = 0.5) -> None:
    """Until no KV-event batch has arrived for ``still_s`` (the publisher sends after the step)."""
    def settled() -> bool:
        last = events.batches[-1][0] if events.batches else 0
        return time.monotonic_ns() - last > still_s * 1e9
    wait_for(settled, 30, "the KV-event stream to settle")


def present_at(order, t_ns: int) -> set[int]:
    have: set[int] = set()
    for recv, kind, hs in order:
        if recv > t_ns:
            break
        (have.update if kind == "stored" else have.difference_update)(hs)
    return have


def causes(ds) -> dict[tuple[str, int], dict[str, int]]:
    out: dict = {}
    for s in ds.table("token_causes").to_pylist():
        name = s["request"].split("-")[1]
        d = out.setdefault((name, s["attempt"]), dict.fromkeys(CAUSES, 0))
        d[s["cause"]] += s["tokens"]
    return out


def nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v}


@pytest.fixture(scope="module")
def run(server, tmp_path_factory):
    srv, events = server
    base = tmp_path_factory.mktemp("causes-run")
    rnd = random.Random(27)
    tok = lambda n: workload.tokens(rnd, n)  # noqa: E731
    A, P = tok(N), tok(640)
    prompts = {"A": A, "X1": P + tok(360), "X2": P + tok(360), "S": A, **{f"F{i}": tok(N) for i in range(4)}}
    metrics = ("vllm:num_preemptions_total",)
    rx = Receiver().start()
    sent, t_sent = {}, {}
    try:
        agent = Attached(srv, base / "ds", rx)
        try:
            t0 = time.monotonic_ns()
            m0 = settled_metrics(srv, metrics)
            t_sent["A"], sent["A"] = time.monotonic_ns(), post(srv, A, "A")
            sent.update(together(srv, {"X1": (prompts["X1"], {}), "X2": (prompts["X2"], {})}))
            t_sent["S"], sent["S"] = time.monotonic_ns(), post(srv, A, "S", cache_salt="salt-1")
            for i in range(4):
                sent[f"F{i}"] = post(srv, prompts[f"F{i}"], f"F{i}")
            time.sleep(0.5)
            t_sent["A2"], sent["A2"] = time.monotonic_ns(), post(srv, A, "A2")
            quiet(events)   # A2's stores reach the sink after its response: L comes after them
            t_sent["L"], sent["L"] = time.monotonic_ns(), post(srv, A, "L", prompt_logprobs=1)
            burst = {f"B{i}": (tok(N), {"max_tokens": 1000, "ignore_eos": True}) for i in range(3)}
            sent.update(together(srv, burst))
            time.sleep(1.0)
            m1 = settled_metrics(srv, metrics)
            t1 = time.monotonic_ns()
            time.sleep(6)   # past the live correlator's lateness: every span streamed while attached
        finally:
            agent.stop()
        live_spans = [s for s in list(rx.got.spans) if s.resource.get("service.name") == "kvtrace"]
        # a second run on the same server, which has now served: what it never saw stored is unseen
        agent2 = Attached(srv, base / "ds2", rx)
        try:
            sent["U"] = post(srv, tok(N), "U")
            time.sleep(1.0)
        finally:
            agent2.stop()
    finally:
        rx.stop()
    chains, order = stream_chains(events.between(t0, t1), {**prompts, "A2": A}, nth={"S": 1})
    return {"ds": Dataset.open(base / "ds"), "ds2": Dataset.open(base / "ds2"), "sent": sent, "t_sent": t_sent,
            "chains": chains, "order": order, "removed": [x for x in order if x[1] == "removed"],
            "preemptions": m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"],
            "spans": live_spans, "base": base}


def test_every_admission_is_tiled_exactly(run):
    ds = run["ds"]
    admits = {(a["request"].split("-")[1], a["attempt"]): a for a in ds.table("admit").to_pylist()}
    got = causes(ds)
    assert set(got) == set(admits)
    for key, d in got.items():
        a = admits[key]
        assert sum(d.values()) == a["prefill_len"], (key, d)
        assert (d["hit_local"], d["hit_external"]) == (a["cached_local"], a["cached_external"]), key
    for name, resp in run["sent"].items():
        if name in got and (name, 0) in got:
            assert got[(name, 0)]["hit_local"] == resp["usage"]["prompt_tokens_details"]["cached_tokens"], name


def test_each_cause_as_the_workload_made_it(run):
    got, sent = causes(run["ds"]), run["sent"]
    assert nonzero(got[("A", 0)]) == {"miss_cold": TOP, "miss_tail": TAIL}
    assert nonzero(got[("X1", 0)]) == {"miss_cold": TOP, "miss_tail": TAIL}
    assert sent["X2"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert nonzero(got[("X2", 0)]) == {"hit_local": 64, "miss_inflight": 576, "miss_cold": 352, "miss_tail": TAIL}
    assert nonzero(got[("S", 0)]) == {"miss_other_key": TOP, "miss_tail": TAIL}
    for i in range(4):
        assert nonzero(got[(f"F{i}", 0)]) == {"miss_cold": TOP, "miss_tail": TAIL}
    hit = sent["A2"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit < TOP, "the fillers evicted none of A's blocks"
    assert nonzero(got[("A2", 0)]) == nonzero({"hit_local": hit, "miss_evicted": TOP - hit, "miss_tail": TAIL})
    assert nonzero(got[("L", 0)]) == {"miss_not_looked_up": N}
    # re-admissions: found again (vLLM's admission) and recomputed, tiling the prefill
    readmits = [k for k in got if k[1] > 0]
    assert readmits and len(readmits) == run["preemptions"]


def test_against_vllms_block_stream(run):
    """The same causes from vLLM's KV events alone (hashes matched by parent and token ids)."""
    chains, order, ds = run["chains"], run["order"], run["ds"]
    segs = collections.defaultdict(list)
    for s in ds.table("token_causes").to_pylist():
        segs[s["request"].split("-")[1]].append(s)
    # cold: A's 31 blocks stored once, by A (nothing before it)
    assert len(chains["A"]) == 31
    # in flight: X2's 18 blocks are X1's blocks 2-19, stored by X1's chunks
    inflight = [s["block_hash"] for s in sorted(segs["X2"], key=lambda s: s["token_start"]) if s["cause"] == "miss_inflight"]
    assert inflight == chains["X1"][2:20]
    assert chains["X2"][:20] == chains["X1"][:20]
    # other key: S's tokens are A's, its blocks another chain; A's were all cached when S came
    assert len(chains["S"]) == 31 and not set(chains["S"]) & set(chains["A"])
    assert set(chains["A"]) <= present_at(order, run["t_sent"]["S"])
    # evicted: A2 hit exactly A's leading blocks still cached by vLLM's stream, and each evicted
    # block it reports was removed by vLLM before A2 came
    have = present_at(order, run["t_sent"]["A2"])
    lead = 0
    while lead < 31 and chains["A"][lead] in have:
        lead += 1
    assert run["sent"]["A2"]["usage"]["prompt_tokens_details"]["cached_tokens"] == lead * BS
    removed_before = {h for recv, _, hs in run["removed"] if recv <= run["t_sent"]["A2"] for h in hs}
    evicted = [s["block_hash"] for s in segs["A2"] if s["cause"] == "miss_evicted" and s["block_hash"]]
    assert evicted and set(evicted) <= removed_before and evicted[0] == chains["A"][lead]
    own = [s for s in segs["A2"] if s["cause"] == "miss_evicted" and s["block_hash"]]
    # evicted by the allocations of the requests between A and A2 (the salted one or the fillers);
    # vLLM frees a request's blocks tail first, so A's later blocks went earlier: more evictions ago
    assert all(s["evicted_by"].split("-")[1] in ("S", "F0", "F1", "F2", "F3") and s["distance_blocks"] >= 1
               and s["distance_ns"] > 0 for s in own)
    assert [x["distance_blocks"] for x in own] == sorted(x["distance_blocks"] for x in own)
    # not looked up: A's blocks were cached again (A2) when L came, and vLLM still hit none
    assert set(chains["A"]) <= present_at(order, run["t_sent"]["L"])
    assert run["sent"]["L"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_unseen_when_the_server_had_served_before_the_attach(run):
    got = causes(run["ds2"])
    assert nonzero(got[("U", 0)]) == {"miss_unseen": TOP, "miss_tail": TAIL}


def test_requests_table_analyze_and_spans_agree(run, kvtrace_cli):
    ds = run["ds"]
    got = causes(ds)
    reqs = {r["request"].split("-")[1]: r for r in ds.table("requests").to_pylist()}
    for name, r in reqs.items():
        first = got[(name, 0)]
        assert {c: r[c] for c in MISSES} == {c: first[c] for c in MISSES}, name
        again = sum(v for (n, att), d in got.items() if n == name and att > 0 for c, v in d.items() if c in MISSES)
        assert r["readmit_recomputed_tokens"] == again
    # kvtrace analyze: per request, in total and by chunk index
    p = kvtrace_cli("analyze", str(run["base"] / "ds"), "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)["misses"]
    total = collections.Counter()
    for (n, att), d in got.items():
        if att == 0:
            total.update(d)
    assert m["first"] == {c: total[c] for c in CAUSES}
    assert {r["request"].split("-")[1]: {c: r[c] for c in CAUSES} for r in m["per_request"]} == \
        {n: d for (n, att), d in got.items() if att == 0}
    chunks = ds.table("chunks").to_pylist()
    by_index = collections.defaultdict(collections.Counter)
    for c in chunks:
        if c["attempt"] == 0:
            by_index[c["chunk_index"]].update({k: c[k] for k in MISSES})
    assert {x["chunk_index"]: {k: x[k] for k in MISSES} for x in m["by_chunk_index"]} == \
        {i: {k: d[k] for k in MISSES} for i, d in by_index.items() if sum(d.values())}
    # the spans streamed live: GenAI usage and kvtrace.miss.* on request and chunk spans
    spans = run["spans"]
    rs = {s.attrs["gen_ai.request.id"].split("-")[1]: s for s in spans if s.name == "kvtrace.request"}
    for name, r in reqs.items():
        a = rs[name].attrs
        assert a["gen_ai.usage.input_tokens"] == r["prompt_len"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == r["cached_local"] + r["cached_external"]
        assert {c: a[f"kvtrace.miss.{c.removeprefix('miss_')}"] for c in MISSES} == {c: r[c] for c in MISSES}
    cs = {(s.attrs["kvtrace.request.id"], s.attrs["kvtrace.chunk.attempt"], s.attrs["kvtrace.step"]): s
          for s in spans if s.name == "kvtrace.prefill_chunk"}
    for c in chunks:
        a = cs[(c["request"], c["attempt"], c["step"])].attrs
        assert {k: a[f"kvtrace.miss.{k.removeprefix('miss_')}"] for k in MISSES} == {k: c[k] for k in MISSES}
