"""kvtrace on a real SGLang server (0.5.23, CPU engine): the hook injected live into the
``sglang::scheduler`` process and loaded at start by SGLang's plugin entry point, checked
against SGLang's own answers.

The workload, on a radix cache of 3,000 tokens (``--max-total-tokens``, page size 1) with
chunks of 256 tokens (``--chunked-prefill-size``):
  A0..A3  a shared 600-token prefix + 400 new tokens each     A1..A3 hit 600 each
  A1'     A1 again                                            hits 999 (SGLang computes the last)
  F0..F2  1,000 new tokens each: the cache overflows           evictions of radix leaves
  A0'     A0 again                                            what survived
  B0..B2  800 new tokens each, decoding up to 1,200 together   a retraction (SGLang's preemption)
  A2'     A2 again
Checked: every request's cached tokens against ``meta_info.cached_tokens`` and its prompt
length; chunks tiling every admission (re-admission after the retraction too); the evicted
hashes against SGLang's ``BlockRemoved`` stream and ``sglang:evicted_tokens_total``; hit
counters against ``sglang:cached_tokens_total``; retractions against
``sglang:num_retracted_requests_total``; each prompt's hashes against SGLang's ``BlockStored``.
"""
from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from kvtrace.correlate.causes import MISSES
from kvtrace.dataset.reader import Dataset
from kvtrace.demo.sglang_server import SglangServer
from tests.helpers import wait_for
from tests.sglang.conftest import STUB, sglang_skip_reason
from tests.vllm.conftest import KvEventSink, free_port
from tests.vllm_checks import removed_hashes

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
CAP, CHUNK = 3000, 256
MASK = 2**64 - 1


def start_server(workdir: Path, cap: int = CAP, plugin: bool = False) -> tuple[SglangServer, KvEventSink]:
    reason = sglang_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("zmq")
    zport = free_port(8180, 8199)
    kv = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}", "bind": True}
    env = {} if plugin else {"SGLANG_PLUGINS": "none"}   # live injection: the plugin's hook kept out
    srv = SglangServer(args=["--chunked-prefill-size", str(CHUNK), "--max-total-tokens", str(cap),
                             "--schedule-conservativeness", "0.1", "--kv-events-config", json.dumps(kv)],
                       port=free_port(8100, 8179, avoid=(zport,)), workdir=workdir, stub=STUB, env=env)
    srv.start()
    try:
        sink = KvEventSink(zport, connect=True).start()
    except BaseException:
        srv.stop()
        raise
    return srv, sink


class Attached:
    """`kvtrace attach --port` until stop() (SIGINT)."""

    def __init__(self, srv, out: Path, expect: str = "SGLang hook injected in engine"):
        self.err = out.parent / f"{out.name}.stderr"
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(srv.port),
                                      "--out", str(out), "--metrics-interval", "1"], stderr=open(self.err, "wb"), cwd=REPO)
        wait_for(lambda: self.proc.poll() is not None or expect in self.err.read_text(errors="replace"), 180,
                 f"'{expect}' from attach")
        assert self.proc.poll() is None, self.err.read_text()[-3000:]
        time.sleep(1.5)   # the hook re-reads the agent flag once a second

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(180) == 0, self.err.read_text()[-3000:]
        return self.err.read_text()


def prompts(seed: int = 7) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    new = lambda n: [rnd.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    p = new(600)
    out = {f"A{i}": p + new(400) for i in range(4)}
    out.update({f"F{i}": new(1000) for i in range(3)})
    out.update({f"B{i}": new(800) for i in range(3)})
    return out


def drive(srv) -> dict[str, dict]:
    """The workload; request id -> SGLang's meta_info for it."""
    ps, meta = prompts(), {}

    def go(rid, name, n=4):
        meta[rid] = srv.generate(ps[name], max_new_tokens=n, rid=rid)["meta_info"]

    for rid, name in [("A0", "A0"), ("A1", "A1"), ("A2", "A2"), ("A3", "A3"), ("A1r", "A1"),
                      ("F0", "F0"), ("F1", "F1"), ("F2", "F2"), ("A0r", "A0")]:
        go(rid, name)
    threads = [threading.Thread(target=go, args=(f"B{i}", f"B{i}", 1200)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(600)
    go("A2r", "A2")
    return meta


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def settled(srv, names) -> dict:
    """/metrics once two scrapes agree (SGLang counts a request in its HTTP process)."""
    prev = None
    for _ in range(40):
        text = srv.metrics()
        cur = {n: metric(text, n) for n in names}
        if cur == prev:
            return cur
        prev = cur
        time.sleep(0.5)
    return prev


COUNTERS = ("sglang:cached_tokens_total", "sglang:evicted_tokens_total", "sglang:num_retracted_requests_total",
            "sglang:prompt_tokens_total")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    work = tmp_path_factory.mktemp("sglang")
    srv, sink = start_server(work)
    try:
        before = settled(srv, COUNTERS)
        att = Attached(srv, work / "ds")
        meta = drive(srv)
        time.sleep(1.0)
        after = settled(srv, COUNTERS)
        log = att.stop()
        time.sleep(0.5)
        yield {"ds": Dataset.open(work / "ds"), "meta": meta, "sink": sink, "log": log, "dir": work / "ds",
               "delta": {k: after[k] - before[k] for k in COUNTERS}, "srv": srv}
    finally:
        srv.stop()
        sink.close()


def first_admits(ds) -> dict:
    return {a["request"]: a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}


def test_cached_tokens_and_chunks_match_sglang(live):
    ds, meta = live["ds"], live["meta"]
    adm = first_admits(ds)
    assert set(adm) == set(meta), (sorted(adm), sorted(meta))
    for rid, m in meta.items():
        a = adm[rid]
        assert a["cached_local"] == m["cached_tokens"], (rid, a, m)
        assert a["prompt_len"] == m["prompt_tokens"], (rid, a, m)
    assert [meta[r]["cached_tokens"] for r in ("A1", "A2", "A3", "A1r")] == [600, 600, 600, 999]
    # every admission (re-admissions after a retraction too) tiled by its chunks, none above 256
    chunks = ds.table("chunk").to_pylist()
    for a in ds.table("admit").to_pylist():
        mine = sorted((c for c in chunks if c["request"] == a["request"] and c["attempt"] == a["attempt"]),
                      key=lambda c: c["chunk_index"])
        assert [c["chunk_index"] for c in mine] == list(range(len(mine))), a
        assert mine[0]["start"] == a["start"], (a, mine[0])
        for x, y in zip(mine, mine[1:]):
            assert x["start"] + x["length"] == y["start"], a["request"]
        assert mine[-1]["start"] + mine[-1]["length"] == a["prefill_len"] and mine[-1]["last"] == 1, a
        assert all(0 < c["length"] <= CHUNK for c in mine)
        assert all(c["last"] == 0 for c in mine[:-1])
    # the requests table agrees
    req = {r["request"]: r for r in ds.table("requests").to_pylist()}
    assert {k: req[k]["cached_tokens"] for k in meta} == {k: m["cached_tokens"] for k, m in meta.items()}
    engine = ds.table("engine").to_pylist()
    assert engine and {(e["name"], e["version"], e["block_size"]) for e in engine} == {("sglang", "0.5.23", 1)}
    stats = ds.table("hook_stats").to_pylist()
    assert stats and stats[-1]["errors"] == 0 and stats[-1]["dropped"] == 0, stats[-1]


def test_evictions_match_block_removed(live):
    ds = live["ds"]
    ev = ds.table("evict").to_pylist()
    ours = Counter(e["block_hash"] for e in ev)
    theirs = removed_hashes(live["sink"].batches)
    assert ours and ours == theirs, (sum(ours.values()), sum(theirs.values()))
    assert len(ev) == live["delta"]["sglang:evicted_tokens_total"]
    # each eviction named the request whose allocation made it, one admitted or running then
    admitted = {(a["step"], a["request"]) for a in ds.table("admit").to_pylist()}
    chunk_steps = {(c["step"], c["request"]) for c in ds.table("chunk").to_pylist()}
    known = {a["request"] for a in ds.table("admit").to_pylist()}
    assert all(e["request"] in known for e in ev), Counter(e["request"] for e in ev if e["request"] not in known)
    prefill = [e for e in ev if any(s == e["step"] for s, _ in chunk_steps)]
    assert all((e["step"], e["request"]) in chunk_steps | admitted for e in prefill)


def test_counters_match_sglang_metrics(live):
    ds, delta = live["ds"], live["delta"]
    adm = first_admits(ds)
    assert sum(a["cached_local"] for a in adm.values()) == delta["sglang:cached_tokens_total"]
    assert sum(a["prompt_len"] for a in adm.values()) == delta["sglang:prompt_tokens_total"]
    pre = ds.table("preempt").to_pylist()
    assert len(pre) == delta["sglang:num_retracted_requests_total"] >= 1
    readmit = [a for a in ds.table("admit").to_pylist() if a["attempt"] > 0]
    assert sorted((p["request"], p["num_preemptions"]) for p in pre) == sorted((a["request"], a["attempt"]) for a in readmit)
    # the metrics stream recorded the same counter
    m = [r for r in ds.table("server_metrics").to_pylist() if r["name"] == "sglang:cached_tokens_total"]
    assert m and max(r["value"] for r in m) >= delta["sglang:cached_tokens_total"]


def test_prompt_hashes_are_sglangs(live):
    """Each prompt's per-token hashes (the hook's, from the token ids it never sends) are the
    ones SGLang's BlockStored events carry for those tokens."""
    stored = set()
    for _, _, (_ts, evs, *_r) in live["sink"].batches:
        for ev in evs:
            if ev.get("type") == "BlockStored":
                stored.update(h & MASK for h in ev["block_hashes"])
    pb = live["ds"].table("prompt_blocks").to_pylist()
    chains: dict[str, dict] = {}
    for r in pb:
        assert r["block_size"] == 1
        chains.setdefault(r["request"], {})[r["first"]] = r["hashes"]
    for rid in ("A0", "F0", "B0"):
        chain = [h for f in sorted(chains[rid]) for h in chains[rid][f]]
        assert len(chain) == live["meta"][rid]["prompt_tokens"]
        assert set(chain) <= stored, rid
    a1 = [h for f in sorted(chains["A1"]) for h in chains["A1"][f]]
    a2 = [h for f in sorted(chains["A2"]) for h in chains["A2"][f]]
    assert a1[:600] == a2[:600] and a1[600] != a2[600]


def test_analyze_and_causes_on_sglang(live):
    out = subprocess.run([sys.executable, "-m", "kvtrace", "analyze", str(live["dir"]), "--json"], capture_output=True,
                         text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    text = json.dumps(rep)
    assert "token-granular" in text, "the report does not say what it counts on a radix cache"
    tc = live["ds"].table("token_causes").to_pylist()
    by = Counter()
    for r in tc:
        if r["attempt"] == 0:
            by[(r["request"], r["cause"])] += r["tokens"]
    meta = live["meta"]
    for rid in meta:
        assert by[(rid, "hit_local")] == meta[rid]["cached_tokens"], rid
        assert sum(v for (r, _), v in by.items() if r == rid) == meta[rid]["prompt_tokens"], rid
    # page size 1: a prompt's last token is its "tail" (SGLang matches at most length - 1); the
    # tree had evicted nothing before the attach, so a token never stored is cold, not unseen
    assert by[("A1", "miss_cold")] == 399 and by[("A1", "miss_tail")] == 1
    assert by[("F0", "miss_cold")] == 999 and by[("A1r", "hit_local")] == 999
    evicted = [r for r in tc if r["request"] == "A0r" and r["cause"] == "miss_evicted"]
    assert sum(r["tokens"] for r in evicted) == 999 - meta["A0r"]["cached_tokens"]
    assert len(evicted) <= 8, "token-granular evictions are not merged into segments"
    assert all(r["evicted_by"] in meta for r in evicted)
    # nothing is unknown: a retracted request's output tokens were freed, never stored (cold)
    assert not [r for r in tc if r["cause"] == "miss_unseen"]
    again = [r for r in tc if r["attempt"] > 0]
    assert again and {r["cause"] for r in again} <= {"hit_local", "miss_evicted", "miss_cold", "miss_tail"}


def test_attach_says_sglang(live):
    assert "SGLang streams: kv_events from tcp://127.0.0.1:" in live["log"]
    assert "server_metrics from http://127.0.0.1:" in live["log"]
    assert re.search(r"SGLang hook injected in engine \d+", live["log"])


def test_plugin_hook_at_start_and_attach_keeps_it(tmp_path):
    """SGLang loads kvtrace's plugin entry point in its scheduler before the first request: the
    hook is installed and inert (SGLang has not set up its logging then, so its line is not in
    the log); `kvtrace attach` finds it active, uses it (no injection) and leaves it there."""
    srv, sink = start_server(tmp_path, plugin=True)
    try:
        ps = prompts(11)
        srv.generate(ps["A0"], max_new_tokens=2, rid="before")   # no agent: nothing recorded, nothing breaks
        att = Attached(srv, tmp_path / "ds", expect="SGLang hook already active in engine")
        meta = {rid: srv.generate(ps[name], max_new_tokens=2, rid=rid)["meta_info"]
                for rid, name in (("P0", "A1"), ("P1", "A2"), ("P2", "A1"))}
        time.sleep(0.5)
        att.stop()
        ds = Dataset.open(tmp_path / "ds")
        adm = first_admits(ds)
        assert {k: adm[k]["cached_local"] for k in meta} == {k: m["cached_tokens"] for k, m in meta.items()}
        assert [meta[k]["cached_tokens"] for k in ("P0", "P1", "P2")] == [600, 600, 999]
        assert "before" not in adm
        # still installed after the agent left: a second attach finds it again
        att2 = Attached(srv, tmp_path / "ds2", expect="SGLang hook already active in engine")
        srv.generate(ps["A3"], max_new_tokens=2, rid="P3")
        time.sleep(0.5)
        att2.stop()
        assert first_admits(Dataset.open(tmp_path / "ds2"))["P3"]["cached_local"] == 600
    finally:
        srv.stop()
        sink.close()


def test_servers_lists_the_sglang_server(live):
    srv = live["srv"]
    out = subprocess.run([sys.executable, "-m", "kvtrace", "servers", "--json"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    (s,) = [s for s in json.loads(out.stdout) if s["port"] == srv.port]
    procs = srv.processes()
    assert s["kind"] == "sglang" and s["version"] == "0.5.23"
    assert s["engine_pids"] == procs["engine"] and s["api_pids"] == procs["api"] and s["worker_pids"] == []
    assert s["hook"]["supported"] is True and s["hook"]["reason"] == ""
    assert s["kv_events"]["enabled"] and s["kv_events"]["bind"] is True
    assert s["plugin"] == "disabled"   # SGLANG_PLUGINS=none keeps it out of this server
    table = subprocess.run([sys.executable, "-m", "kvtrace", "servers"], capture_output=True, text=True, cwd=REPO,
                           timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert "SGLang 0.5.23" in table.stdout and "sglang::" not in table.stdout, table.stdout



def test_inject_by_hand(live):
    """`kvtrace inject --pid SCHEDULER` puts SGLang's hook in (not vLLM's); it stays after the
    command exits, through served requests, until `--remove` takes it out."""
    (sched,) = live["srv"].processes()["engine"]

    def inject(*flags):
        p = subprocess.run([sys.executable, "-m", "kvtrace", "inject", "--pid", str(sched), *flags, "--json"],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
        assert p.returncode == 0, p.stderr
        (row,) = json.loads(p.stdout)
        assert row["pid"] == sched and row["role"] == "engine", row
        return row

    assert not inject("--status")["installed"]
    row = inject()
    assert row["installed"] and row["reason"] == "", row
    time.sleep(2.5)   # an owned hook would check its owner (once a second) and leave
    live["srv"].generate([5, 6, 7], max_new_tokens=2)
    row = inject("--status")
    assert row["installed"], row["reason"]
    assert "removed: its agent" not in live["srv"].log_path.read_text()
    assert not inject("--remove")["installed"]
    assert not inject("--status")["installed"]

@pytest.mark.long   # a second server: make test-long
def test_whatif_radix_replay_predicts_another_cache_size(live, tmp_path):
    """`kvtrace whatif` replays the recorded run through its model of SGLang's radix cache at
    6,000 tokens; a real server at --max-total-tokens 6000 given the same workload hits within
    2 points of the prediction (and the replay at the recorded 3,000 within 2 of the recording)."""
    out = subprocess.run([sys.executable, "-m", "kvtrace", "whatif", str(live["dir"]), "--cache-blocks", "3000,6000",
                          "--json"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["recorded"]["engine"] == "sglang" and res["recorded"]["cache_blocks"] == CAP
    pred = {r["cache_blocks"]: 100 * r["hit_rate"] for r in res["predictions"]}
    meta = live["meta"]
    recorded = 100 * sum(m["cached_tokens"] for m in meta.values()) / sum(m["prompt_tokens"] for m in meta.values())
    assert abs(pred[3000] - recorded) <= 2, (pred, recorded)
    srv, sink = start_server(tmp_path, cap=6000)
    try:
        real = drive(srv)
    finally:
        srv.stop()
        sink.close()
    actual = 100 * sum(m["cached_tokens"] for m in real.values()) / sum(m["prompt_tokens"] for m in real.values())
    assert actual - recorded > 4, "the other cache size should change the hit rate for this check to mean anything"
    assert abs(pred[6000] - actual) <= 2, (pred[6000], actual)


def test_spans_of_an_sglang_dataset(live):
    """`kvtrace export` of the SGLang dataset: a trace per request with its chunks, GenAI usage
    and miss causes, checked against SGLang's own answers."""
    from tests.otlp_receiver import Receiver

    rx = Receiver().start()
    try:
        out = subprocess.run([sys.executable, "-m", "kvtrace", "export", str(live["dir"]), "--otlp", rx.grpc_url],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        spans = list(rx.got.spans)
    finally:
        rx.stop()
    meta = live["meta"]
    reqs = {s.attrs["gen_ai.request.id"]: s for s in spans if s.name == "kvtrace.request"}
    assert set(reqs) == set(meta)
    for rid, m in meta.items():
        a = reqs[rid].attrs
        assert a["gen_ai.usage.input_tokens"] == m["prompt_tokens"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == m["cached_tokens"]
        causes = sum(a.get("kvtrace.miss." + c.removeprefix("miss_"), 0) for c in MISSES)
        assert causes == m["prompt_tokens"] - m["cached_tokens"], (rid, a)
    chunks = [s for s in spans if s.name == "kvtrace.prefill_chunk"]
    assert len(chunks) == live["ds"].table("chunks").num_rows
    assert {s.trace_id for s in chunks} <= {s.trace_id for s in reqs.values()}
