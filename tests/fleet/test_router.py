"""Two vLLM replicas behind a real router (vllm-router 0.1.17, round robin), traced by one
`kvtrace attach --port A --port B`: which replica served each request, each replica's hits,
and the hit rate routing lost, checked against the replicas' own answers.

Workload: 24 token-id prompts, each one of 4 shared 128-token prefixes (4 blocks of 32) and a
40-token suffix of its own, sent one at a time.  Round robin alternates the replicas, so a
prefix is often cached on the other one (routing); a 12-block pool per replica evicts (eviction).

The independent side:
- which replica served: the replica whose own access log has one more completion;
- its hit: vLLM's `cached_tokens` in the response;
- every replica's cache at each request: replayed from its own KV-event stream (BlockStored,
  BlockRemoved), the prompt's chain of vLLM block hashes found in the stream from the tokens
  the test sent (parent hash and the blake2b of each block's token ids);
- routing loss of a request: its missed full blocks the other replica held; the longest prefix
  the other replica held.
"""
from __future__ import annotations

import json
import os
import random
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtrace.analysis.report import analyze
from kvtrace.dataset.reader import Dataset
from kvtrace.demo.server import VllmServer
from kvtrace.servers.kvdecode import tokens_hash
from tests.fleet.router import ROUTER, Router
from tests.helpers import Attached, dev_post, post_completion, wait_for
from tests.vllm.conftest import free_port, prefix_caching, vllm_skip_reason

pytestmark = [pytest.mark.root]

BLOCK, PREFIX, SUFFIX, N, POOL = 32, 128, 40, 24, 12
PROMPT = PREFIX + SUFFIX
TOP = BLOCK * ((PROMPT - 1) // BLOCK)   # the most vLLM can hit: 160 of 168


def replica(base: Path, core: int, name: str) -> VllmServer:
    pub = free_port(5600, 5699)
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}
    return VllmServer(args=prefix_caching("--num-gpu-blocks-override", str(POOL + 1), "--kv-events-config", json.dumps(kv),
                                          "--served-model-name", "tiny", max_len=384),
                      env={"VLLM_PLUGINS": "", "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_SERVER_DEV_MODE": "1"},
                      port=free_port(8300, 8399), workdir=base / name)


def completions(srv: VllmServer) -> int:
    return srv.log_path.read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')



def prompts() -> list[list[int]]:
    rnd = random.Random(3701)
    heads = [[rnd.randrange(100, 30000) for _ in range(PREFIX)] for _ in range(4)]
    order = [0, 0, 1, 1, 0, 2, 2, 1, 3, 3, 0, 1, 2, 2, 3, 0, 0, 1, 3, 2, 1, 1, 0, 3]
    return [heads[k] + [rnd.randrange(100, 30000) for _ in range(SUFFIX)] for k in order]


def drive(router: Router, reps: list[VllmServer], out: Path) -> list[dict]:
    """The workload through the router, one request at a time, traced by one attach to both
    replicas; per request the replica that served it (its access log) and vLLM's cached_tokens."""
    sent = []
    with Attached([r.port for r in reps], out, "--metrics-interval", "5", engines=2):
        for i, prompt in enumerate(prompts()):
            before = [completions(r) for r in reps]
            t0 = time.time_ns()   # wall clock, as vLLM stamps its KV-event batches
            resp = post_completion(router.url, "tiny", prompt, f"fleet{i}", max_tokens=2)
            wait_for(lambda: sum(completions(r) for r in reps) == sum(before) + 1, 30, "the access log")
            served = [k for k, r in enumerate(reps) if completions(r) > before[k]]
            sent.append({"prompt": prompt, "t0": t0, "replica": served[0], "port": reps[served[0]].port,
                         "cached": resp["usage"]["prompt_tokens_details"]["cached_tokens"]})
            time.sleep(0.2)
        time.sleep(1.5)
    return sent


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Round robin, recorded; then both replicas' prefix caches reset and the same workload
    through the router's cache-aware policy, recorded again."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    if not os.path.exists(ROUTER):
        pytest.skip(f"no vllm-router at {ROUTER}: run bash scripts/setup-router")
    base = tmp_path_factory.mktemp("fleet")
    reps = [replica(base, 0, "a"), replica(base, 1, "b")]
    router = None
    try:
        with ThreadPoolExecutor(2) as pool:   # both start at once
            list(pool.map(lambda r: r.start(timeout=900), reps))
        router = Router(base, reps, "round_robin")
        sent = drive(router, reps, base / "ds")
        router.stop()
        for r in reps:
            dev_post(r.url, "/reset_prefix_cache")
        router = Router(base, reps, "cache_aware")
        again = drive(router, reps, base / "ds-cache-aware")
        yield {"sent": sent, "ds": Dataset.open(base / "ds"), "dir": base / "ds", "ports": [r.port for r in reps],
               "cache_aware": again, "cache_aware_dir": base / "ds-cache-aware"}
    finally:
        if router is not None:
            router.stop()
        for r in reps:
            r.stop()


# ----------------------------------------------------------------------------- the independent side


def chains(ds: Dataset, sent: list[dict]) -> list[list[int]]:
    """Each prompt's vLLM block hashes, found in the replicas' KV events from the tokens sent."""
    stored = {}
    for e in ds.table("kv_events").to_pylist():
        if e["event"] == "BlockStored":
            stored[(e["parent_hash"] or 0, e["tokens_hash"])] = e["block_hash"]
    out = []
    for s in sent:
        chain, parent = [], 0
        for i in range(PROMPT // BLOCK):
            h = stored.get((parent, tokens_hash(s["prompt"][i * BLOCK:(i + 1) * BLOCK])))
            if h is None:
                break
            chain.append(h)
            parent = h
        out.append(chain)
    return out


def caches_at(ds: Dataset, port: int, t: int) -> tuple[set, set]:
    """One replica's cached block hashes, and those it ever stored, from its own KV events of
    the engine steps that ended before ``t`` (vLLM's wall-clock stamp of each batch: however
    late a batch reaches the subscriber)."""
    held, ever = set(), set()
    rows = sorted((e for e in ds.table("kv_events").to_pylist() if e["server"] == port and e["batch_wall_ns"] < t),
                  key=lambda e: (e["seq"], e["event_idx"], e["block_idx"]))
    for e in rows:
        if e["event"] == "BlockStored":
            held.add(e["block_hash"])
            ever.add(e["block_hash"])
        elif e["event"] == "BlockRemoved":
            held.discard(e["block_hash"])
        elif e["event"] == "AllBlocksCleared":
            held.clear()
    return held, ever


def expected(run: dict) -> list[dict]:
    ds, sent, ports = run["ds"], run["sent"], run["ports"]
    out = []
    for s, chain in zip(sent, chains(ds, sent)):
        assert len(chain) == PROMPT // BLOCK, "a prompt's blocks are missing from the KV events"
        other, _ = caches_at(ds, ports[1 - s["replica"]], s["t0"])
        mine, ever = caches_at(ds, ports[s["replica"]], s["t0"])
        longest = next((i for i in range(TOP // BLOCK) if chain[i] not in other), TOP // BLOCK)
        # each missed full block by its own state here (a cached one after a miss: the first miss's)
        routing = evicted = 0
        first = None
        for i in range(s["cached"] // BLOCK, TOP // BLOCK):
            state = first if chain[i] in mine else ("evicted" if chain[i] in ever else "cold")
            first = first or state
            if chain[i] in other:
                routing += BLOCK
            elif state == "evicted":
                evicted += BLOCK
        out.append({**s, "routing": routing, "evicted": evicted, "elsewhere": longest * BLOCK})
    return out


def ours(ds: Dataset) -> list[dict]:
    """kvtrace's per request, in the order they arrived (the test sends one at a time; the router
    gives vLLM ids of its own): its server, hit, routing tokens, elsewhere, evicted."""
    server = {r["pid"]: r["server"] for r in ds.table("servers").to_pylist()}
    admit = sorted((a for a in ds.table("admit").to_pylist() if a["attempt"] == 0), key=lambda a: a["mark_ns"])
    req = {r["request"]: r for r in ds.table("requests").to_pylist()}
    return [{"port": server[a["pid"]], "cached": a["cached_local"], "routing": req[a["request"]]["miss_other_engine"],
             "elsewhere": req[a["request"]]["cached_elsewhere"], "evicted": req[a["request"]]["miss_evicted"]}
            for a in admit]


# ----------------------------------------------------------------------------- the tests


def test_each_request_is_placed_on_the_replica_that_served_it(fleet):
    """kvtrace's replica of every request (its engine's pid, joined through the servers table)
    is the one whose access log grew; its hit is vLLM's cached_tokens; round robin alternated."""
    got = ours(fleet["ds"])
    assert len(got) == N
    for i, s in enumerate(fleet["sent"]):
        assert (got[i]["port"], got[i]["cached"]) == (s["port"], s["cached"]), i
    assert [s["replica"] for s in fleet["sent"]] in ([k % 2 for k in range(N)], [(k + 1) % 2 for k in range(N)])


def test_routing_loss_equals_the_replicas_own_events(fleet):
    """Per request, the prompt tokens kvtrace says the other replica held (miss_other_engine)
    and the longest prefix it held (cached_elsewhere) equal what the replicas' own KV events
    say they held at that moment, and its evicted tokens (here before, held by neither now) what
    its own replica's events say; the workload has both routing and eviction losses."""
    got, want = ours(fleet["ds"]), expected(fleet)
    for i, w in enumerate(want):
        g = got[i]
        assert (g["routing"], g["evicted"], g["elsewhere"]) == (w["routing"], w["evicted"], w["elsewhere"]), (i, g, w)
    assert sum(w["routing"] for w in want) > 0 and sum(w["evicted"] for w in want) > 0
    print(f"[fleet] routing {sum(w['routing'] for w in want)} tokens, "
          f"evicted {sum(w['evicted'] for w in want)}, hits {sum(w['cached'] for w in want)}")


def test_streams_and_tables_name_their_server(fleet):
    """Both replicas' KV events and /metrics are in the dataset, each row with its replica's
    port; the servers table names both replicas' API servers and EngineCores."""
    ds, ports = fleet["ds"], set(fleet["ports"])
    assert {e["server"] for e in ds.table("kv_events").to_pylist()} == ports
    assert {m["server"] for m in ds.table("server_metrics").to_pylist()} == ports
    roles = defaultdict(set)
    for r in ds.table("servers").to_pylist():
        roles[r["server"]].add(r["role"])
    assert set(roles) == ports and all({"api", "engine"} <= v for v in roles.values())


def test_analyze_reports_each_replica_and_the_fleet(fleet):
    """`analyze`'s fleet section: per replica its requests and hits (the responses' sums); for
    the fleet the hit rate, the routed hit rate (each request at its longest prefix) and the
    shortfall's parts, which sum to the prompt tokens with the hits."""
    rep = analyze(fleet["dir"])
    f, want = rep["fleet"], expected(fleet)
    assert f["by"] == "server" and [s["server"] for s in f["servers"]] == sorted(fleet["ports"])
    for s in f["servers"]:
        mine = [w for w in want if w["port"] == s["server"]]
        assert (s["requests"], s["hit_tokens"], s["prompt_tokens"]) == (len(mine), sum(w["cached"] for w in mine),
                                                                         PROMPT * len(mine))
    x = f["fleet"]
    assert (x["routing"], x["eviction"]) == (sum(w["routing"] for w in want), sum(w["evicted"] for w in want))
    assert x["routed_tokens"] == sum(max(w["cached"], w["elsewhere"]) for w in want)
    assert x["hit_tokens"] + sum(x[p] for p in ("workload", "routing", "eviction", "other")) == x["prompt_tokens"] == PROMPT * N
    assert x["routed_hit_rate"] > x["hit_rate"]
    print(f"[fleet] hit {x['hit_rate']:.2%}, routed {x['routed_hit_rate']:.2%}, ideal {x['ideal_hit_rate']:.2%}; "
          f"shortfall " + ", ".join(f"{p} {x['shortfall'][p]:.2%}" for p in ("workload", "routing", "eviction", "other")))


def test_whatif_of_the_routing_policy_holds_against_a_real_run(fleet):
    """`whatif --router` on the round-robin recording: the recorded routing replayed gives the
    measured hit rate exactly; cache_aware predicted from it is within 2 points of the real
    cache-aware run (the router's access logs: where it sent each request), its split over the
    replicas as the real run's."""
    from kvtrace.analysis.whatif import router

    res = {p["policy"]: p for p in router.run(fleet["dir"], ["round_robin", "cache_aware"])["predictions"]}
    measured = sum(s["cached"] for s in fleet["sent"]) / (PROMPT * N)
    assert res["recorded"]["hit_tokens"] == res["round_robin"]["hit_tokens"] == sum(s["cached"] for s in fleet["sent"])
    real = fleet["cache_aware"]
    real_rate = sum(s["cached"] for s in real) / (PROMPT * N)
    counts = sorted((sum(1 for s in real if s["replica"] == k) for k in (0, 1)), reverse=True)
    assert sorted(res["cache_aware"]["requests_per_replica"], reverse=True) == counts
    assert abs(res["cache_aware"]["hit_rate"] - real_rate) <= 0.02, (res["cache_aware"]["hit_rate"], real_rate)
    rep = analyze(fleet["cache_aware_dir"])   # kvtrace's own record of the real run says the same
    assert rep["reuse"]["hit_tokens"] == sum(s["cached"] for s in real)
    print(f"[fleet] round robin measured {measured:.2%} (replayed {res['recorded']['hit_rate']:.2%}); cache_aware "
          f"predicted {res['cache_aware']['hit_rate']:.2%}, real {real_rate:.2%} ({counts[0]}/{counts[1]} requests)")
