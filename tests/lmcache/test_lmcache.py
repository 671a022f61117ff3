"""kvtrace attached to vLLM whose KV cache has an external tier: LMCache 0.5.6 in multiprocess
mode (LMCacheMPConnector, LMCache's own server, an `fs` L2 on disk), checked against vLLM's
answers, vLLM's /metrics, LMCache's log and metrics, its process's I/O counters and its files.

Workload: 3 prompts of 712 tokens sharing a 512-token prefix, sent one by one (round 1), then
vLLM's prefix cache is emptied (POST /reset_prefix_cache) and the same prompts are sent again
(round 2).  LMCache stores whole 256-token chunks only: each prompt's first 2 chunks, which are
the shared prefix, so 2 chunks in all.  Round 1: p0 cold, p1 and p2 hit the prefix in vLLM's own
cache (512 local).  Round 2: p0 finds the prefix in LMCache (512 external, loaded), p1 and p2
then hit it locally again.  The server runs with `--l2-store-policy skip_l1`: a stored chunk
leaves L1 once it is on disk, so round 2's load is read back from the L2 files.
"""
from __future__ import annotations

import collections
import json
import random
import re
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import MODELS
from tests import helpers
from tests.helpers import Attached, wait_for
from kvtrace.correlate.causes import CAUSES
from tests.lmcache.conftest import BLOCK, CHUNK
from tests.otlp_receiver import Receiver
from tests.vllm.test_hook import settled_metrics

pytestmark = pytest.mark.root

LMCACHE_L2_STORE_POLICY = "skip_l1"   # read by the lmcache_server fixture: loads come from disk

PREFIX, PROMPT = 512, 712
PROMPTS = 3
EXTERNAL = "vllm:external_prefix_cache_hits_total"
METRICS = (EXTERNAL, "vllm:prefix_cache_hits_total")

# One L2 file holds one chunk's KV: tokens x 2 (K and V) x layers x KV heads x head dim x bytes
# per element.  The tiny model (kvtrace/demo/server.py TINY_LLAMA): 2 layers, 4 KV heads, head
# dim 256 / 4 = 64, bfloat16 (2 bytes): 256 x 2 x 2 x 4 x 64 x 2 = 524,288 bytes.
TINY = MODELS["tiny"]
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}[TINY["torch_dtype"]]
CHUNK_BYTES = (CHUNK * 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"]
               * (TINY["hidden_size"] // TINY["num_attention_heads"]) * DTYPE_BYTES)

# LMCache's log lines (INFO), as 0.5.6 writes them
STORED = re.compile(r"Stored (\d+) tokens in [0-9.]+ seconds")
RETRIEVED = re.compile(r"Retrieved (\d+) tokens in [0-9.]+ seconds")
PREFETCHED = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\)")


def l2_settled(lmc, still_s: float = 1.0) -> dict[str, int]:
    """The L2 files once some exist and none has appeared or grown for ``still_s`` (LMCache writes
    L1 to L2 asynchronously, after the request's response)."""
    state = {"files": None, "since": 0.0}

    def settled():
        files = lmc.l2_files()
        if files != state["files"]:
            state.update(files=files, since=time.monotonic())
            return None
        return files if files and time.monotonic() - state["since"] >= still_s else None

    return wait_for(settled, 60, f"LMCache's L2 files in {lmc.l2_dir}", step=0.2)


def lmcache_counters(lmc, timeout: float = 10.0) -> dict[str, float]:
    """LMCache's counters (``lmcache_mp_..._total``, summed over labels) once two scrapes 0.5 s
    apart agree (its metrics are fed by an event bus, after the fact)."""
    def scrape() -> dict[str, float]:
        out: dict[str, float] = {}
        for line in lmc.metrics().splitlines():
            if line.startswith("lmcache_mp_") and "_total" in line.split(" ", 1)[0]:
                name = re.split(r"[{ ]", line, maxsplit=1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    prev, deadline = None, time.monotonic() + timeout
    while True:
        cur = scrape()
        if cur == prev or time.monotonic() > deadline:
            return cur
        prev = cur
        time.sleep(0.5)


@pytest.fixture(scope="module")
def run(lmcache_server, lmcache_vllm, tmp_path_factory):
    lmc, srv = lmcache_server, lmcache_vllm
    base = tmp_path_factory.mktemp("lmcache-run")
    rnd = random.Random(56)
    prefix = workload.tokens(rnd, PREFIX)
    prompts = {f"p{i}": prefix + workload.tokens(rnd, PROMPT - PREFIX) for i in range(PROMPTS)}
    sent: dict[str, dict] = {}
    rx = Receiver().start()
    try:
        with Attached(srv.port, base / "ds", "--otlp", rx.grpc_url, timeout=180) as agent:
            m0 = settled_metrics(srv, METRICS)
            for name, p in prompts.items():
                sent[f"r1{name}"] = helpers.post_completion(srv.url, srv.model, p, f"r1{name}")
            files1 = l2_settled(lmc)   # round 1's chunks on disk before round 2 asks for them
            helpers.dev_post(srv.url, "/reset_prefix_cache")
            m1 = settled_metrics(srv, METRICS)
            mark, io1, lm1 = len(lmc.log()), lmc.io(), lmcache_counters(lmc)
            t2 = time.monotonic_ns()
            for name, p in prompts.items():
                sent[f"r2{name}"] = helpers.post_completion(srv.url, srv.model, p, f"r2{name}")
            m2 = settled_metrics(srv, METRICS)
            io2, lm2 = lmc.io(), lmcache_counters(lmc)
            t3 = time.monotonic_ns()
            time.sleep(6)   # past the live correlator's lateness: every span streamed while attached
    finally:
        rx.stop()
    log = lmc.log()
    (base / "observed.json").write_text(json.dumps({"metrics": [m0, m1, m2], "io": [io1, io2], "lmcache": [lm1, lm2],
                                                    "sent": sent}, indent=1))
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "m": (m0, m1, m2), "io": (io1, io2), "lm": (lm1, lm2),
            "log1": log[:mark], "log2": log[mark:], "files1": files1, "files": lmc.l2_files(), "round2": (t2, t3),
            "stderr": agent.err.read_text(errors="replace"),
            "spans": [x for x in list(rx.got.spans) if x.resource.get("service.name") == "kvtrace"]}


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_lmcache_external_hits_match_vllm(run):
    sent, (m0, m1, m2) = run["sent"], run["m"]
    ext_r1, ext_r2 = m1[EXTERNAL] - m0[EXTERNAL], m2[EXTERNAL] - m1[EXTERNAL]
    # vLLM and LMCache, before kvtrace: round 1 stored the prefix's 2 chunks and hit nothing
    # external; round 2 loaded it back for p0 (as many tokens as LMCache retrieved) and p0's
    # load put it in vLLM's own cache for p1 and p2
    assert sum(int(n) for n in STORED.findall(run["log1"])) == PREFIX, run["log1"][-3000:]
    assert ext_r1 == 0
    assert ext_r2 == PREFIX and sum(int(n) for n in RETRIEVED.findall(run["log2"])) == ext_r2
    assert [cached(sent[f"r1p{i}"]) for i in range(PROMPTS)] == [0, PREFIX, PREFIX]
    assert [cached(sent[f"r2p{i}"]) for i in range(PROMPTS)] == [PREFIX, PREFIX, PREFIX]

    # kvtrace: each request's first admission, local + external = vLLM's cached tokens
    ds = run["ds"]
    assert not ds.problems, ds.problems
    admits = {(a["request"].split("-")[1], a["attempt"]): a for a in ds.table("admit").to_pylist()}
    got = {name: (admits[(name, 0)]["cached_local"], admits[(name, 0)]["cached_external"]) for name in sent}
    assert {n: loc + ext for n, (loc, ext) in got.items()} == {n: cached(r) for n, r in sent.items()}, got
    # ... the external part summing to vLLM's counter over the run, all of it in round 2, in whole chunks
    assert sum(ext for _loc, ext in got.values()) == m2[EXTERNAL] - m0[EXTERNAL], got
    r2 = sum(ext for n, (_loc, ext) in got.items() if n.startswith("r2"))
    assert r2 > 0 and r2 % CHUNK == 0, got


def test_tokens_in_the_partial_tier_chunk_miss_for_that_cause(run):
    """Each prompt's last 200 tokens sit in a partial LMCache chunk ([512, 712)), which LMCache
    never stores.  Round 2, after vLLM's cache was emptied, recomputes them: of the tokens vLLM
    can hit at most (32 x floor(711 / 32) = 704), the 192 past the prefix miss because of the
    partial chunk; round 1 computed them for the first time (cold)."""
    req = {r["request"].split("-")[1]: r for r in run["ds"].table("requests").to_pylist()}
    top = BLOCK * ((PROMPT - 1) // BLOCK)
    for name, r in sorted(req.items()):
        want = top - PREFIX if name.startswith("r2") else 0
        assert (r["miss_tier_partial"], r["miss_tail"]) == (want, PROMPT - top), (name, r)
        assert r["cached_tokens"] + sum(r[c] for c in CAUSES[2:]) == PROMPT, (name, r)
    assert [req[f"r1p{i}"]["miss_cold"] for i in range(PROMPTS)] == [top, top - PREFIX, top - PREFIX]


def test_lmcache_loads_from_disk(run):
    # on disk: one file per stored chunk, each exactly one chunk's KV (CHUNK_BYTES, above)
    files = run["files"]
    assert len(files) == PREFIX // CHUNK and set(files.values()) == {CHUNK_BYTES}, files
    assert run["files1"] == files   # round 2 stored nothing new
    # round 2's first prefetch found the prefix in L2 only (skip_l1), and LMCache's own metrics
    # agree.  LMCache prefetches a request's chunks at its lookup, before vLLM has used its own
    # cache: p1 and p2 read the prefix again, from disk, or from L1 while p0's prefetched copies
    # are still there (they are freed once retrieved)
    pre = [tuple(int(x) for x in m) for m in PREFETCHED.findall(run["log2"])]
    l2_keys = sum(p[3] for p in pre)
    assert pre and pre[0][2:] == (0, PREFIX // CHUNK) and l2_keys >= PREFIX // CHUNK, run["log2"][-3000:]
    # the server read them with O_DIRECT: its read_bytes rose by what it loaded (exactly, here;
    # at least, so that a module it imports meanwhile cannot fail the test)
    io1, io2 = run["io"]
    assert io2["read_bytes"] - io1["read_bytes"] >= l2_keys * CHUNK_BYTES, (io1, io2, pre)
    lm1, lm2 = run["lm"]
    delta = {k: v - lm1.get(k, 0.0) for k, v in lm2.items() if v != lm1.get(k, 0.0)}
    assert delta.get("lmcache_mp_l2_prefetch_load_completed_chunks_total") == l2_keys, delta


def test_the_connectors_load_and_ends_as_vllms_scheduler_drove_them(run, kvtrace_cli):
    """kvtrace's records of LMCacheMPConnector, from vLLM's scheduler alone: p0's load in round 2
    (async: the request waited for it), its blocks and bytes, its completion, and every request's
    end handed to the connector, which stores it asynchronously."""
    ds, sent = run["ds"], run["sent"]
    name = lambda r: r["request"].split("-")[1]   # noqa: E731
    (alloc,) = ds.table("kv_alloc").to_pylist()
    admit = {name(a): a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    assert name(alloc) == "r2p0" and alloc["connector"] == "LMCacheMPConnector" and alloc["async"] == 1
    assert (alloc["first"], alloc["external"]) == (admit["r2p0"]["cached_local"], admit["r2p0"]["cached_external"])
    # bytes: the load's blocks x block size x KV bytes per token (2 x layers x KV heads x head dim x
    # dtype bytes = CHUNK_BYTES / CHUNK): exactly the L2 files LMCache loaded it from
    bs = 32
    assert alloc["blocks"] == PREFIX // bs and alloc["nbytes"] == alloc["blocks"] * bs * CHUNK_BYTES // CHUNK
    assert alloc["nbytes"] == sum(run["files"].values())
    done = [d for d in ds.table("kv_done").to_pylist() if d["direction"] == "load"]
    assert [(name(d), d["ok"]) for d in done] == [("r2p0", 1)]
    # (the workers start the load in the step that allocated it and may report it done in that
    # step's output: the request is scheduled in a later step)
    assert done[0]["t_ns"] > alloc["t_ns"] and done[0]["step"] >= alloc["step"]
    chunks = {name(c): c for c in ds.table("chunk").to_pylist() if c["chunk_index"] == 0}
    assert chunks["r2p0"]["step"] > done[0]["step"] and chunks["r2p0"]["start"] == PREFIX
    # every request's end: the blocks of its computed tokens, kept for an async store that finished
    ends = {name(f): f for f in ds.table("kv_finish").to_pylist()}
    assert set(ends) == set(sent) and all(f["delay_free"] == 1 for f in ends.values())
    assert all(f["nbytes"] == f["blocks"] * bs * CHUNK_BYTES // CHUNK and f["blocks"] >= PROMPT // bs
               for f in ends.values()), ends
    stored = {name(d) for d in ds.table("kv_done").to_pylist() if d["direction"] == "store"}
    assert stored == set(sent)
    # the report: the same load, and no mismatch with vLLM's counters
    p = kvtrace_cli("analyze", str(ds.root), "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    (conn,) = rep["connector"]["connectors"]
    assert (conn["external_tokens"], conn["bytes"], conn["async_loads"], conn["failed_loads"]) == \
        (PREFIX, alloc["nbytes"], 1, 0), conn
    assert not rep.get("warnings"), rep.get("warnings")
    # which tier served each prompt token: vLLM's own cache (device), LMCache's L1 or L2, recomputed;
    # r2p0's 512 came from the L2 files (its lookup's L2 chunks), with its disk read and retrieve
    per = {name(r): r for r in rep["tier"]["per_request"]}
    assert set(per) == set(sent)
    for n, r in per.items():
        assert r["device"] == admit[n]["cached_local"] and r["tier_l1"] + r["tier_l2"] == admit[n]["cached_external"]
        assert r["device"] + r["tier_l1"] + r["tier_l2"] + r["recomputed"] == PROMPT
        assert r["partial_chunk_tokens"] == PROMPT % CHUNK
    assert (per["r2p0"]["tier_l2"], per["r2p0"]["l2_chunks"], per["r2p0"]["retrieve_bytes"] >= 2 * CHUNK_BYTES) == \
        (PREFIX, [0, 1], True)
    assert per["r2p0"]["l2_read_bytes"] >= 2 * CHUNK_BYTES and per["r2p0"]["l2_read_ms"] > 0


def test_the_tier_servers_disk_io_as_the_kernel_saw_it(run, lmcache_server):
    """attach --port followed vLLM's kv-transfer config to LMCache's server and traced it: its
    L2 reads in round 2, as kvtrace's file_io rows, are the bytes its process read from the disk
    (/proc/PID/io) and the chunks it loaded; its writes are the L2 files."""
    lmc, ds = lmcache_server, run["ds"]
    (tier,) = ds.table("tiers").to_pylist()
    assert (tier["kind"], tier["pid"], tier["port"], tier["connector"], tier["version"], tier["same_netns"]) == \
        ("lmcache", lmc.pid, lmc.port, "LMCacheMPConnector", "0.5.6", True)
    assert tier["storage"] == f"fs:{lmc.l2_dir}" and tier["chunk_tokens"] == CHUNK
    assert f"tracing LMCache's server (pid {lmc.pid}" in run["stderr"]
    rows = [r for r in ds.table("file_io").to_pylist()
            if r["pid"] == lmc.pid and (r["path"] or "").startswith(str(lmc.l2_dir) + "/") and r["ret"] > 0]
    reads = {"read", "pread64", "readv", "preadv", "preadv2"}
    t2, t3 = run["round2"]
    read2 = sum(r["ret"] * (r["weight"] or 1) for r in rows if r["syscall"] in reads and t2 <= r["start_ns"] <= t3)
    io1, io2 = run["io"]
    l2_keys = sum(int(m[3]) for m in PREFETCHED.findall(run["log2"]))
    assert read2 == l2_keys * CHUNK_BYTES == io2["read_bytes"] - io1["read_bytes"], (read2, l2_keys, io1, io2)
    # LMCache writes each chunk to NAME.tmp, then renames it NAME.data
    written = collections.Counter()
    for r in rows:
        if r["syscall"] not in reads:
            written[r["path"].rsplit("/", 1)[1].removesuffix(".tmp") + ".data"] += r["ret"] * (r["weight"] or 1)
    assert dict(written) == run["files"], (dict(written), run["files"])


def test_the_tier_servers_own_counters_are_recorded(run):
    """LMCache's metrics, scraped by kvtrace inside its server's network namespace into
    tier_metrics: each of its counters ends at the value LMCache served the test after the run."""
    rows = run["ds"].table("tier_metrics").to_pylist()
    assert rows and {r["kind"] for r in rows} == {"lmcache"}
    last: dict[str, float] = {}
    for r in sorted(rows, key=lambda r: r["ts_ns"]):
        if r["name"].startswith("lmcache_mp_") and r["name"].endswith("_total"):
            key = (r["name"], r["labels"])
            last[key] = r["value"]
    ended = collections.Counter()
    for (name, _labels), v in last.items():
        ended[name] += v
    _lm1, lm2 = run["lm"]
    assert ended["lmcache_mp_l2_prefetch_load_completed_chunks_total"] > 0
    # (its loops' ticks count time, not work: they go on between the two scrapes)
    work = {k: v for k, v in lm2.items() if not k.endswith("_ticks_total")}
    assert len(work) > 10 and {k: ended[k] for k in work} == work


def test_each_requests_row_and_span_carry_the_tier_it_loaded_from(run):
    """The requests table (correlated at stop) and the request spans streamed while attached: p0 of
    round 2 loaded the prefix from LMCache (tokens, bytes, its wait for the async load); no other
    request loaded anything."""
    ds = run["ds"]
    name = lambda r: r["request"].split("-")[1]   # noqa: E731
    (alloc,) = ds.table("kv_alloc").to_pylist()
    (done,) = [d for d in ds.table("kv_done").to_pylist() if d["direction"] == "load"]
    want = {n: ("", 0, 0, 0) for n in run["sent"]}
    want["r2p0"] = ("LMCacheMPConnector", PREFIX, alloc["nbytes"], done["t_ns"] - alloc["t_ns"])
    cols = ("kv_connector", "connector_load_tokens", "connector_load_bytes", "connector_load_wait_ns")
    rows = {name(r): tuple(r[c] for c in cols) for r in ds.table("requests").to_pylist()}
    assert rows == want
    spans = {s.attrs["gen_ai.request.id"].split("-")[1]: s for s in run["spans"] if s.name == "kvtrace.request"}
    assert set(spans) == set(want)
    keys = ("kvtrace.request.kv_connector", "kvtrace.request.connector_load_tokens",
            "kvtrace.request.connector_load_bytes", "kvtrace.request.connector_load_wait_ns")
    assert {n: tuple(s.attrs[k] for k in keys) for n, s in spans.items()} == want


def test_the_hook_in_lmcaches_server_sees_each_lookup_load_and_store(run, lmcache_server):
    """kvtrace's hook injected in LMCache's server: each lookup's L1/L2 hits as LMCache logged
    them, the L2 reads (disk -> L1) of the round-2 lookups as the kernel saw them, the one
    retrieve (L1 -> vLLM) of p0's load, the stores and L2 writes as LMCache logged and wrote them."""
    lmc, ds = lmcache_server, run["ds"]
    assert f"LMCache hook injected in its server {lmc.pid}" in run["stderr"], run["stderr"][-2000:]
    admit_ids = {a["request"].split("-")[1]: a["request"] for a in ds.table("admit").to_pylist()}
    lookups = sorted(ds.table("tier_lookup").to_pylist(), key=lambda r: r["t_ns"])
    logged = [tuple(int(x) for x in m) for m in PREFETCHED.findall(run["log1"] + run["log2"])]
    assert [(r["l1"] + r["l2"], r["chunks"], r["l1"], r["l2"]) for r in lookups if r["l1"] + r["l2"]] == logged
    assert {r["request"] for r in lookups} <= set(admit_ids.values()) and all(r["tier"] == "lmcache" for r in lookups)
    # ... and LMCache's own counters (every lookup since it started was made while attached)
    _lm1, lm2 = run["lm"]
    assert (sum(r["l1"] for r in lookups), sum(r["l2"] for r in lookups)) == \
        (lm2["lmcache_mp_lookup_hit_l1_keys_total"], lm2["lmcache_mp_lookup_hit_l2_keys_total"])
    ops = ds.table("tier_op").to_pylist()
    by = collections.defaultdict(list)
    for o in ops:
        by[o["op"]].append(o)
    # L2 reads: every one for a lookup of a request, all ok; round 2's bytes = what the kernel saw read
    t2, t3 = run["round2"]
    assert by["l2_read"] and all(o["request"] in admit_ids.values() and o["ok"] == 1 for o in by["l2_read"])
    l2_keys = sum(int(m[3]) for m in PREFETCHED.findall(run["log2"]))
    assert sum(o["nbytes"] for o in by["l2_read"] if t2 <= o["t_start_ns"] <= t3) == l2_keys * CHUNK_BYTES
    assert sum(o["keys"] for o in by["l2_read"]) == sum(m[3] for m in logged)
    # the retrieve: p0 of round 2, its 512 tokens, their 2 chunks' bytes and the pickle around them
    (ret,) = by["retrieve"]
    assert (ret["request"], ret["num_tokens"], ret["ok"]) == (admit_ids["r2p0"], PREFIX, 1)
    assert 2 * CHUNK_BYTES <= ret["nbytes"] < 2 * CHUNK_BYTES + 65536
    # stores: the tokens LMCache logged as stored; L2 writes: the files on disk
    assert sum(o["num_tokens"] for o in by["store"] if o["ok"]) == sum(int(n) for n in STORED.findall(run["log1"]))
    assert sum(o["nbytes"] for o in by["l2_write"]) == sum(run["files"].values())
    assert sum(o["keys"] for o in by["l2_write"]) == len(run["files"])


def test_whatif_fits_the_recorded_lmcache_tier(run, kvtrace_cli, lmcache_server):
    """`whatif` reads the recorded tier: LMCache's chunk and L1 size from its options, the KV bytes
    a token from the L2 files it read (CHUNK_BYTES / CHUNK), and what its retrieves and L2 reads
    cost per token from its own operations; it replays at the recorded tier by default."""
    p = kvtrace_cli("whatif", str(run["ds"].root), "--json", "--storage-tier", "lmcache,lmcache:0.0001@2", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)
    gb = lmcache_server.l1_size_gb
    assert res["recorded"]["storage_tier"] == f"lmcache:{gb:g}"
    tm = res["tier_model"]
    assert (tm["chunk_tokens"], tm["l1_bytes"], tm["token_bytes"]) == (CHUNK, int(gb * (1 << 30)), CHUNK_BYTES / CHUNK)
    assert tm["fitted_on_l2_reads"] >= 1 and tm["fitted_on_retrieves"] >= 1, tm
    assert tm["l2_read_ns_per_token"] > 0 and tm["retrieve_ns_per_token"] > 0, tm
    assert [r["storage_tier"] for r in res["predictions"]] == ["lmcache", "lmcache:0.0001@2"]
    d = kvtrace_cli("whatif", str(run["ds"].root), "--json", timeout=300)
    assert d.returncode == 0 and [r["storage_tier"] for r in json.loads(d.stdout)["predictions"]] == [f"lmcache:{gb:g}"]
