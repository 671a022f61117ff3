"""kvtrace attached to a hybrid model (two KV cache groups: a 64-token sliding window and full
attention; kvtrace.demo.server.TINY_GEMMA3), checked against vLLM's responses and its per-group
BlockStored/BlockRemoved stream.

By default (prefix_cache_retention_interval 0) the window group caches only the blocks a later
hit can stop at: the two before a prompt's end.  A prompt that shares only a prefix of an
earlier one finds the prefix in full attention, but the window group lacks the two blocks
before the prefix's end: vLLM's hybrid rule cuts the hit, and kvtrace calls those tokens
`miss_group` (naming the window group).  Blocks of 32 tokens; prompts of 648 tokens (20
hittable blocks + 8).
  A        P, new                                   cold 640, tail 8
  F1-F2    new fillers
  B        P's first 480 tokens + new ones          full attention 480; cut by the window group
  C        P again                                  the whole of P: the window group kept its end
  D        P's first 480 tokens + other new ones    480: B pinned the junction (vLLM's
                                                    shared-prefix checkpoint), so both groups hold it
Each request's hit and its `miss_group` tokens are computed again from the event stream alone
(each group's cache, vLLM's rule) and must equal vLLM's and kvtrace's.

Before that, on the fresh server, an attach records a shared-prefix workload (system_prompts)
that `whatif` replays through its model of the two groups' managers
(kvtrace.analysis.whatif.hybridpool): at the recorded 100-block pool it must reproduce the
recorded hit rate within 2 points and the evictions within 10%
(tests/vllm/test_hybrid_whatif.py checks its prediction for another pool size against a real
run).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer
from tests import helpers
from tests.vllm.conftest import KvEventSink, free_port, vllm_skip_reason
from tests.vllm_checks import events

pytestmark = pytest.mark.root

BS, WINDOW, N, SHARED = 32, 64, 648, 480
M64 = 2**64 - 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("zmq")
    base = tmp_path_factory.mktemp("hybrid")
    zport = free_port(8350, 8399)
    sink = KvEventSink(zport).start()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    srv = VllmServer(args=["--block-size", str(BS), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                           "--max-num-batched-tokens", "256", "--max-model-len", "1024",
                           "--num-gpu-blocks-override", "100", "--kv-events-config", json.dumps(kv)],
                     port=free_port(8350, 8399, avoid=(zport,)), env={"VLLM_PLUGINS": ""}, workdir=base / "server",
                     model_name="hybrid")
    try:
        srv.start(timeout=600)
    except Exception:
        sink.close()
        raise
    try:
        system = system_prompts(srv, base / "ds-system")   # first: whatif replays from an empty cache
        yield {**scenario(srv, sink, base), "system": system}
    finally:
        srv.stop()
        sink.close()


def scenario(srv, sink, base: Path) -> dict:
    rnd = random.Random(361)
    p = workload.tokens(rnd, N)
    plan = [("A", p), ("F1", workload.tokens(rnd, N)), ("F2", workload.tokens(rnd, N)),
            ("B", p[:SHARED] + workload.tokens(rnd, N - SHARED)), ("C", p),
            ("D", p[:SHARED] + workload.tokens(rnd, N - SHARED))]
    sent, at = {}, {}
    with helpers.Attached(srv.port, base / "ds"):
        t0 = time.monotonic_ns()
        for name, prompt in plan:
            time.sleep(0.5)   # the previous request's events are in
            at[name] = time.monotonic_ns()
            sent[name] = helpers.post_completion(srv.url, srv.model, prompt, name, max_tokens=1)
        time.sleep(1.5)
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "at": at, "batches": list(sink.batches), "t0": t0}


def system_prompts(srv, ds: Path, seed: int = 3610, n: int = 24, prefixes: int = 4) -> dict:
    """24 requests, one after another, each one of 4 system prompts of 320
    tokens (round robin) and a question of its own (150-249 tokens), 4 output tokens each."""
    rnd = random.Random(seed)
    pre = [workload.tokens(rnd, 320) for _ in range(prefixes)]
    sent = {}
    with helpers.Attached(srv.port, ds):
        for i in range(n):
            p = pre[i % prefixes] + workload.tokens(rnd, 150 + (i * 37) % 100)
            sent[f"w{i}"] = helpers.post_completion(srv.url, srv.model, p, f"w{i}", max_tokens=4)
        time.sleep(1.5)
    return {"ds": ds, "sent": sent,
            "hit_rate": sum(cached(r) for r in sent.values()) / sum(r["usage"]["prompt_tokens"] for r in sent.values())}


def cached(resp) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def by_name(rows) -> dict:
    return {r["request"].split("-")[1]: r for r in rows}


def chains(ds) -> dict:
    out: dict = {}
    for r in ds.table("prompt_blocks").to_pylist():
        out.setdefault(r["request"].split("-")[1], {}).update({r["first"] + i: h for i, h in enumerate(r["hashes"])})
    return out


def cache_at(batches, t_ns: int) -> dict[int, set]:
    """Each group's cached hashes, from the stream's events received before ``t_ns``."""
    groups: dict[int, set] = {}
    for recv, _seq, (_ts, evs, *_r) in sorted(batches, key=lambda b: b[1]):
        if recv > t_ns:
            break
        for ev in events(evs):
            g = ev.get("group_idx") or 0
            if ev["type"] == "BlockStored":
                groups.setdefault(g, set()).update(h & M64 for h in ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                groups.setdefault(g, set()).difference_update(h & M64 for h in ev["block_hashes"])
            elif ev["type"] == "AllBlocksCleared":
                groups.clear()
    return groups


def hybrid_hit(cache: dict, chain: dict, fg: int, wg: int) -> tuple[int, int]:
    """(full attention's prefix, the hit after the window group's rule) in tokens: vLLM's rule,
    from the events alone (group fg full attention, wg the window)."""
    top = (N - 1) // BS
    full = 0
    while full < top and chain.get(full) in cache.get(fg, ()):
        full += 1
    need, run = -(-(WINDOW - 1) // BS), 0
    for i in range(full - 1, -1, -1):
        if chain.get(i) in cache.get(wg, ()):
            run += 1
            if run >= need:
                return full * BS, (i + run) * BS
        else:
            run = 0
    return full * BS, run * BS


def test_groups_are_recorded_as_vllm_made_them(run):
    rows = run["ds"].table("kv_group").to_pylist()
    assert sorted((r["group"], r["kind"], r["block_size"], r["window"]) for r in rows) == \
        [(0, "sliding_window", BS, WINDOW), (1, "full_attention", BS, 0)] or \
        sorted((r["group"], r["kind"], r["block_size"], r["window"]) for r in rows) == \
        [(0, "full_attention", BS, 0), (1, "sliding_window", BS, WINDOW)]
    assert {r["align"] for r in rows} == {BS}


def test_hits_and_group_cuts_equal_vllm_and_its_events(run):
    ds, sent = run["ds"], run["sent"]
    req = by_name(ds.table("requests").to_pylist())
    ch = chains(ds)
    kinds = {r["kind"]: r["group"] for r in ds.table("kv_group").to_pylist()}
    got, want = {}, {}
    for name in sent:
        full, hit = hybrid_hit(cache_at(run["batches"], run["at"][name]), ch[name], kinds["full_attention"],
                               kinds["sliding_window"])
        want[name] = (cached(sent[name]), hit, full - hit)
        got[name] = (req[name]["cached_tokens"], req[name]["cached_local"], req[name]["miss_group"])
    assert got == want
    assert want["B"][2] > 0 and want["D"][1] == SHARED, f"the workload did not cut B's hit: {want}"
    for name, r in req.items():   # every token has one cause
        assert sum(r[k] for k in r if k.startswith("miss_")) + r["cached_tokens"] == N, name


def test_the_cut_names_the_window_group(run):
    ds = run["ds"]
    window = next(r["group"] for r in ds.table("kv_group").to_pylist() if r["kind"] == "sliding_window")
    cut = [t for t in ds.table("token_causes").to_pylist() if t["cause"] == "miss_group"]
    assert cut and {t["group"] for t in cut} == {window}


def test_analyze_splits_evictions_and_thrash_by_group(run, kvtrace_cli):
    removed: dict[int, int] = {}
    for _recv, _seq, (_ts, evs, *_r) in [b for b in run["batches"] if b[0] >= run["t0"]]:   # this attach's
        for ev in events(evs):
            if ev["type"] == "BlockRemoved":
                removed[ev.get("group_idx") or 0] = removed.get(ev.get("group_idx") or 0, 0) + len(ev["block_hashes"])
    p = kvtrace_cli("analyze", str(run["ds"].root), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    ev = rep["chunking"]["evictions"]
    assert len(removed) == 2, f"the workload evicted from one group only: {removed}"
    assert {g["kv_group"]: g["evictions"] for g in ev["by_group"]} == removed
    assert sum(g["evictions"] for g in ev["by_group"]) == ev["evictions"]
    assert rep["misses"]["first"]["miss_group"] == sum(
        r["miss_group"] for r in run["ds"].table("requests").to_pylist()) > 0


def whatif(ds: Path, kvtrace_cli, *args) -> dict:
    p = kvtrace_cli("whatif", str(ds), "--json", *args, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_whatif_reproduces_the_recorded_hybrid_run(run, kvtrace_cli):
    sys_run = run["system"]
    wi = whatif(sys_run["ds"], kvtrace_cli)
    (pred,) = wi["predictions"]
    rec = wi["recorded"]
    print(f"hybrid whatif: recorded {100 * rec['hit_rate']:.2f}% / {rec['evictions']} evictions, vLLM "
          f"{100 * sys_run['hit_rate']:.2f}%; replay {100 * pred['hit_rate']:.2f}% / {pred['evictions']}")
    assert rec["cache_blocks"] == 100 and abs(rec["hit_rate"] - sys_run["hit_rate"]) < 0.005
    assert 0 < sys_run["hit_rate"] < 0.5, "the workload should both hit and miss"
    assert abs(100 * pred["hit_rate"] - 100 * rec["hit_rate"]) <= 2.0
    assert abs(pred["evictions"] - rec["evictions"]) <= 0.10 * max(rec["evictions"], 1)
