"""The hook inside vLLM (kvtrace.hook.vllm.hook), checked against independent sources.

test_records_match_vllm drives a real vLLM CPU server (plugin loaded from its entry point, no
flags) while `kvtrace attach` captures its EngineCore and Worker, then compares the hook's
records with vLLM's HTTP usage, its ZMQ KV events and its /metrics.  The other tests run the
hook's install/uninstall and worker-side paths in vLLM's interpreter, without root.
"""
from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvtrace.hook.transport import FLAG_PATH
from kvtrace.hook.vllm.hook import FLUSH_EVERY_NS, HOOK_VERSION
from kvtrace.hook.wire import RECORDS, kv_step_rows
from kvtrace.demo.server import vllm_python
from kvtrace.servers import registry

VLLM_HOOK = registry.kind("vllm").hook_module

from tests import helpers
from tests.helpers import wait_for

from .conftest import BLOCK_SIZE, vllm_skip_reason

REPO = Path(__file__).resolve().parents[2]
ENGINE_ID = re.compile(r"^cmpl-(?P<rid>.+)-0-[0-9a-f]{8}$")
HOOK_TABLES = ("hook_start", "hook_stats", "step", "chunk", "admit", "evict", "preempt")


# ---------------------------------------------------------------------------------------------
# Helpers


def metric_sum(text: str, name: str) -> float:
    """Sum of a Prometheus sample over its label sets (``name`` or ``name{...}``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled_metrics(server, names, timeout=10.0) -> dict[str, float]:
    """The metrics once two scrapes 0.5 s apart agree (the API server logs stats asynchronously)."""
    prev = None
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        cur = {n: metric_sum(text, n) for n in names}
        if cur == prev or time.monotonic() > deadline:
            return cur
        prev = cur
        time.sleep(0.5)


def rows(ds, name: str, pid: int | None = None) -> list[dict]:
    out = ds.table(name).to_pylist()
    return [r for r in out if pid is None or r.get("pid") == pid]


class Agent:
    """`kvtrace attach` as a subprocess; stopped with SIGINT like a user would."""

    def __init__(self, pids: list[int], out: Path):
        cmd = [sys.executable, "-m", "kvtrace", "attach", "--out", str(out), "--quiet"]
        for p in pids:
            cmd += ["--pid", str(p)]
        self.err = out.parent / "agent.stderr"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.err, "wb"), cwd=REPO)

    def flag_is_mine(self) -> bool:
        try:
            return (Path(FLAG_PATH) / str(self.proc.pid)).exists()
        except OSError:
            return False

    def wait_attached(self, timeout=120.0) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}: {self.err.read_text()[-2000:]}")
            return self.flag_is_mine()

        wait_for(ready, timeout, "the agent's flag file")

    def stop(self, timeout=120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


def tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(3, 32000) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# The end-to-end check against vLLM's own numbers


@pytest.mark.root
def test_records_match_vllm(hooked_server, tmp_path):
    hs = hooked_server
    srv = hs.server
    procs = srv.processes()
    assert len(procs["engine"]) == 1 and procs["workers"], procs
    engine, workers = procs["engine"][0], procs["workers"]
    log = srv.log_path.read_text(errors="replace")
    assert f"kvtrace hook {HOOK_VERSION} installed (engine+worker)" in log, "plugin did not install in EngineCore"
    assert f"kvtrace hook {HOOK_VERSION} installed (worker)" in log, "plugin did not install in the Worker"

    rnd = random.Random(20261130)
    probes = [tokens(rnd, 200) for _ in range(3)]
    prefix = tokens(rnd, 600)
    shared = [prefix + tokens(rnd, rnd.randrange(400, 901)) for _ in range(6)]
    # admission needs the whole prompt to fit, so preemption comes from decode growth:
    # 1000 prompt + 1000 generated tokens = 63 blocks, and any two of them outgrow the 121
    # if they run together.  Sent one after another they need not: on a loaded CI machine the
    # API server handed the second to the engine 390 steps after the first and the third after
    # both had finished.  So the burst is queued while the scheduler is paused.
    burst = [tokens(rnd, 1000) for _ in range(3)]
    metric_names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total")

    # Phase A, no agent (hook inert): probe completions at temperature 0.
    detached = {f"probeA{i}": hs.post(p, f"probeA{i}", max_tokens=16, ignore_eos=True) for i, p in enumerate(probes)}

    out = tmp_path / "ds"
    agent = Agent([engine, *workers], out)
    sent: dict[str, tuple[list[int], dict]] = {}
    try:
        agent.wait_attached()
        time.sleep(1.2)  # the hook re-reads the flag at most once per second, at a step
        m0 = settled_metrics(srv, metric_names)
        t_window0 = time.monotonic_ns()

        # Phase B: shared-prefix prompts one by one, a concurrent burst that outgrows the
        # 121-block cache while decoding (preemption), then the first prompt again.
        for i, p in enumerate(shared):
            sent[f"shared{i}"] = (p, hs.post(p, f"shared{i}"))
        results: dict[str, dict] = {}

        def run(name, p):
            results[name] = hs.post(p, name, max_tokens=1000, ignore_eos=True)

        threads = [threading.Thread(target=run, args=(f"burst{i}", p)) for i, p in enumerate(burst)]
        helpers.dev_post(srv.url, "/pause?mode=keep&clear_cache=false")
        try:
            for t in threads:
                t.start()
                time.sleep(0.05)
            time.sleep(2.0)  # the engine is idle: ample time for the API server to queue all three
        finally:
            helpers.dev_post(srv.url, "/resume")
        for t in threads:
            t.join(300)
        for i, p in enumerate(burst):
            sent[f"burst{i}"] = (p, results[f"burst{i}"])
        sent["again0"] = (shared[0], hs.post(shared[0], "again0"))

        # Phase C, agent attached: the probes again (their blocks were evicted in phase B).
        attached = {}
        for i, p in enumerate(probes):
            attached[f"probeC{i}"] = hs.post(p, f"probeC{i}", max_tokens=16, ignore_eos=True)
            sent[f"probeC{i}"] = (p, attached[f"probeC{i}"])

        time.sleep(0.5)
        t_window1 = time.monotonic_ns()
        m1 = settled_metrics(srv, metric_names)
        time.sleep(1.5)  # one agent flush interval
    finally:
        rc = agent.stop()
    assert rc == 0, agent.err.read_text()[-3000:]

    from kvtrace.dataset.reader import Dataset

    ds = Dataset.open(out)
    assert not ds.problems, ds.problems
    run = ds.runs()[-1]
    assert sum(run["lost_events"].values()) == 0 and run["dropped_events"] == 0, run

    # -- hook health ------------------------------------------------------------------------
    starts = rows(ds, "hook_start", engine)
    assert [s["role"] for s in starts] == ["engine"] and starts[0]["vllm_version"].startswith("0.32")
    stats = rows(ds, "hook_stats", engine)
    assert stats and stats[-1]["errors"] == 0 and stats[-1]["dropped"] == 0, stats[-1:]

    steps = sorted(rows(ds, "step", engine), key=lambda r: r["step"])
    chunks = rows(ds, "chunk", engine)
    admits = rows(ds, "admit", engine)
    evicts = rows(ds, "evict", engine)
    preempts = rows(ds, "preempt", engine)
    assert steps and chunks and admits

    def rid(engine_id: str) -> str:
        m = ENGINE_ID.match(engine_id)
        assert m, engine_id
        return m["rid"]

    # -- steps: consecutive, well-timed, their counters agree with the per-request records ---
    ids = [s["step"] for s in steps]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "a step record is missing"
    by_step = collections.defaultdict(lambda: collections.Counter())
    for c in chunks:
        by_step[c["step"]]["prefill_reqs"] += 1
        by_step[c["step"]]["prefill_tokens"] += c["length"]
    for a in admits:
        by_step[a["step"]]["resumed_reqs" if a["resumed"] else "new_reqs"] += 1
    for e in evicts:
        by_step[e["step"]]["evicted"] += 1
    for p in preempts:
        by_step[p["step"]]["preempted"] += 1
    for s in steps:
        assert s["t_start_ns"] <= s["t_sched_end_ns"] <= s["t_end_ns"] <= s["mark_ns"], s
        assert s["prefill_tokens"] + s["decode_tokens"] == s["total_tokens"], s
        got = by_step.get(s["step"], collections.Counter())
        for key in ("prefill_reqs", "prefill_tokens", "new_reqs", "resumed_reqs", "evicted", "preempted"):
            assert s[key] == got[key], (key, s, dict(got))
    assert set(by_step) <= set(ids)

    # -- sends: the hook writes its records at a step end once FLUSH_EVERY_NS have passed since
    # its last write (or when the engine runs out of requests): never later, and for several
    # steps at once.  A step ended a send when its record was written before the next step ended.
    ends = {s["step"] for s, nxt in zip(steps, steps[1:] + [None]) if nxt is None or s["mark_ns"] < nxt["t_end_ns"]}
    assert len(ends) * 2 < len(steps), f"{len(ends)} writes for {len(steps)} steps: records are not batched"
    last_send, held = None, []
    for s in steps:
        if last_send is not None and s["t_end_ns"] - last_send >= FLUSH_EVERY_NS and s["step"] not in ends:
            held.append(s["step"])
        if s["step"] in ends:
            last_send = s["t_end_ns"]
    assert not held, f"steps {held[:5]} ended {FLUSH_EVERY_NS} ns after the last write and were not sent"

    # -- chunks tile each admission's prompt; the first starts at the admission's hit ----------
    admit_of = {(a["request"], a["attempt"]): a for a in admits}
    assert len(admit_of) == len(admits), "two admit records for one (request, attempt)"
    per_admission = collections.defaultdict(list)
    for c in chunks:
        per_admission[(c["request"], c["attempt"])].append(c)
    assert set(per_admission) == set(admit_of)
    for key, cs in per_admission.items():
        a = admit_of[key]
        cs.sort(key=lambda c: c["step"])
        assert [c["chunk_index"] for c in cs] == list(range(len(cs))), key
        assert cs[0]["step"] == a["step"] and cs[0]["start"] == a["start"], key
        for prev, nxt in zip(cs, cs[1:]):
            assert nxt["start"] == prev["start"] + prev["length"], (key, prev, nxt)
        assert cs[-1]["start"] + cs[-1]["length"] == a["prefill_len"], key
        assert [c["last"] for c in cs] == [0] * (len(cs) - 1) + [1], key
        assert all(c["resumed"] == (key[1] > 0) for c in cs)

    # -- every request sent while attached: first admission's hit == vLLM's cached_tokens ------
    first = {rid(a["request"]): a for a in admits if a["attempt"] == 0}
    assert set(first) == set(sent), (sorted(first), sorted(sent))
    for name, (prompt, resp) in sent.items():
        a = first[name]
        usage = resp["usage"]
        assert a["prompt_len"] == a["prefill_len"] == usage["prompt_tokens"] == len(prompt), name
        assert a["cached_local"] + a["cached_external"] == usage["prompt_tokens_details"]["cached_tokens"], (name, a, usage)
        assert a["start"] == a["cached_local"] + a["cached_external"], a
        assert a["hit_blocks"] * BLOCK_SIZE == a["cached_local"], a
        assert (a["last_hit_hash"] != 0) == (a["hit_blocks"] > 0), a
    assert first["shared1"]["cached_local"] == 600 // BLOCK_SIZE * BLOCK_SIZE  # the shared prefix's full blocks

    # -- evictions: the same multiset of (hash, medium, group) as vLLM's BlockRemoved events -----
    batches = hs.events.between(t_window0, t_window1)
    seqs = [b[1] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a KV-event batch was lost"
    removed = collections.Counter()
    for _, _, (ts, events, *_rest) in batches:
        for ev in events:
            if ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    removed[(h, ev.get("medium"), ev.get("group_idx") or 0)] += 1
            assert ev["type"] != "AllBlocksCleared"
    hooked = collections.Counter((e["block_hash"], e["medium"], e["group"]) for e in evicts)
    assert sum(removed.values()) > 0, "the workload did not force any eviction"
    assert hooked == removed, (sum(hooked.values()), sum(removed.values()))
    names = set(sent)
    assert all(rid(e["request"]) in names for e in evicts), "an eviction outside a request's allocation"

    # -- preemptions: each is followed by a re-admission of the same request -------------------
    burst_steps = sorted(a["step"] for a in admits if a["attempt"] == 0 and rid(a["request"]).startswith("burst"))
    assert burst_steps[-1] - burst_steps[0] <= 16, f"the burst reached the scheduler at steps {burst_steps}, not at once"
    assert m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"] == len(preempts)
    assert preempts, "the burst did not cause a preemption"
    for p in preempts:
        assert (p["request"], p["num_preemptions"]) in admit_of, p
        assert p["computed_before"] > 0 and p["num_tokens"] >= p["computed_before"]
        assert rid(p["for_request"]) in sent, p  # the running request that needed a block

    # -- /metrics: prefix-cache hits and queries count first admissions only --------------------
    first_hits = sum(a["cached_local"] for a in first.values())
    readmit_hits = sum(a["cached_local"] for a in admits if a["attempt"] > 0)
    assert m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"] == first_hits
    assert m1["vllm:prefix_cache_queries_total"] - m0["vllm:prefix_cache_queries_total"] == sum(a["prompt_len"] for a in first.values())

    # -- temperature 0 completions identical without (phase A) and with the agent (phase C) ------
    for i in range(len(probes)):
        a, c = detached[f"probeA{i}"], attached[f"probeC{i}"]
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "probe blocks were not evicted"
        assert a["choices"][0]["token_ids"] == c["choices"][0]["token_ids"]

    summary = {
        "steps": len(steps), "chunks": len(chunks), "admits": len(admits), "evictions": len(evicts),
        "block_removed_events": sum(removed.values()), "preemptions": len(preempts),
        "first_admission_hits": first_hits, "readmission_hits": readmit_hits,
        "metric_hits_rise": m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"],
        "kv_event_batches": len(batches), "hook_records": stats[-1]["emitted"],
    }
    print("kvtrace hook check:", json.dumps(summary))
    (tmp_path / "summary.json").write_text(json.dumps(summary))


# ---------------------------------------------------------------------------------------------
# Install/uninstall and the worker side, in vLLM's interpreter (no root, no server)

SELFTEST = textwrap.dedent(r'''
    import importlib.util, json, logging, os, sys, tempfile, threading, time
    records = logging.getLogger("vllm.kvtrace_hook")
    messages = []
    class H(logging.Handler):
        def emit(self, r): messages.append(r.getMessage())
    records.addHandler(H()); records.setLevel(logging.INFO); records.propagate = False

    from kvtrace.hook import api
    from kvtrace.hook.vllm import hook as h
    from kvtrace.hook.wire import CODEC, MAGIC
    import vllm
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    targets = [(Scheduler, "schedule"), (Scheduler, "update_from_output"), (Scheduler, "_preempt_request"),
               (KVCacheManager, "allocate_slots"), (BlockPool, "_maybe_evict_cached_block"),
               (KVConnectorFactory, "create_connector")]
    orig = {t: t[0].__dict__[t[1]] for t in targets}
    same = lambda: all(t[0].__dict__[t[1]] is orig[t] for t in targets)
    out = {}

    # a signature that differs: nothing patched, one message naming it
    real = BlockPool.__dict__["_maybe_evict_cached_block"]
    def _maybe_evict_cached_block(self, blk, why): pass
    BlockPool._maybe_evict_cached_block = _maybe_evict_cached_block
    out["mismatch_installed"] = h.install(["engine", "worker"])
    BlockPool._maybe_evict_cached_block = real
    out["mismatch_messages"] = [m for m in messages if "inactive" in m]
    out["mismatch_untouched"] = same() and not h._REGISTRY

    # another vLLM version with the same code: decided by the checks, not the version string
    messages.clear()
    v, vllm.__version__ = vllm.__version__, "0.99.0"
    out["version_installed"] = h.install(["engine"])
    out["version_status"] = h.status()["reason"]
    h.uninstall()
    vllm.__version__ = v
    out["version_messages"] = [m for m in messages if "inactive" in m]

    # install twice == once; a second copy of the module (live injection) replaces, never stacks
    out["installed"] = h.install(["engine", "worker"])
    wrapped = {t: t[0].__dict__[t[1]] for t in targets}
    out["n_patched"] = len(h._REGISTRY)
    out["again"] = h.install(["engine", "worker"]) and len(h._REGISTRY) == out["n_patched"] and \
        all(t[0].__dict__[t[1]] is wrapped[t] for t in targets)
    # detached, the per-call wrappers are out of vLLM's classes; an attach puts them back
    h._hot(False)
    out["hot_out"] = [t[1] for t in targets if t[0].__dict__[t[1]] is orig[t]]
    h._hot(True)
    out["hot_in"] = all(t[0].__dict__[t[1]] is wrapped[t] for t in targets)
    h._hot(False)                             # uninstall restores whichever is in place
    spec = importlib.util.spec_from_file_location("kvtrace_hook_copy", h.__file__)
    h2 = importlib.util.module_from_spec(spec); spec.loader.exec_module(h2)
    h2.install(["engine", "worker"])
    unbox = lambda o: getattr(o, "__func__", o)
    out["copy_wraps_originals"] = all(
        unbox(getattr(unbox(t[0].__dict__[t[1]]), "__kvtrace_original__")) is unbox(orig[t]) for t in targets)
    h2.uninstall()
    out["restored_by_copy"] = same()
    h.uninstall()
    out["restored"] = same()

    # worker side: a connector class is wrapped; records reach a pipe standing in for the BPF program
    class Connector:
        def bind_connector_metadata(self, connector_metadata): self.md = connector_metadata
        def start_load_kv(self, forward_context, **kwargs): time.sleep(0.002)
        def wait_for_layer_load(self, layer_name): time.sleep(0.001)
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): time.sleep(0.001)
        def wait_for_save(self):
            if getattr(self, "fail", False): raise KeyError("connector's own error")
            time.sleep(0.001)
    saved = {n: Connector.__dict__[n] for n in h.CONNECTOR_METHODS}
    assert h.install(["worker"])
    h._patch_connector_class(Connector)
    flag = tempfile.mktemp()
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    h.T.flag_path, h.T.mark_fd = flag, wfd
    c = Connector()

    def step(layers=2):
        c.bind_connector_metadata("md"); c.start_load_kv(None)
        for i in range(layers):
            c.wait_for_layer_load(f"layer{i}"); c.save_kv_layer(f"layer{i}", None, None)
        c.wait_for_save()

    def drain():
        data = b""
        try:
            while True: data += os.read(rfd, 1 << 20)
        except BlockingIOError: pass
        return data

    step()                                    # no agent: nothing
    api.kv_transfer("load", "r0", 1, 10, 1, 2)
    out["idle_bytes"] = len(drain()) + len(h._Q) + len(h.T.buf)
    with open(flag, "w") as f: f.write(f"{os.getpid()}\n")
    h.T.next_check = 0
    t0 = time.monotonic_ns()
    h._last["flush"] = 0
    step(); first = drain()                   # the first send after an attach goes at once
    step(layers=0); held = drain()            # a step within 100 ms of it is held...
    time.sleep(3 * h.FLUSH_EVERY_NS / 1e9); later = drain()   # ...and sent by the hook's thread,
    out["sends"] = [len(first) > 0, len(held), len(later) > 0]
    out["later_head"] = CODEC.decode_frame(later)[:1]          # naming the thread that made them
    out["my_tid"] = threading.get_native_id()
    api.kv_transfer("load", "req-7", [5, 6, 7], 3 * 65536, t0, t0 + 1000, source="fileconnector")
    api.kv_transfer("bogus", "x", None, "n", 0, 0)
    c.fail = True
    try:
        step()
    except KeyError as e:
        out["own_error"] = str(e)
    c.fail = False
    h._flush(time.monotonic_ns())
    data = first + later + drain()
    recs, pos = [], 0
    import struct
    while pos < len(data):
        if data[pos:pos + 4] == MAGIC: pos += 4; continue
        tid, n = struct.unpack_from("<HH", data, pos)
        recs += CODEC.decode_frame(MAGIC + data[pos:pos + 4 + n]); pos += 4 + n
    out["records"] = recs
    out["errors"] = h.T.errors
    h.uninstall()
    out["connector_restored"] = all(Connector.__dict__[n] is saved[n] for n in saved)
    out["api_after_uninstall"] = api.installed()
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def selftest():
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, KVTRACE_FLAG="/nonexistent/kvtrace-flag")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([vllm_python(), "-c", SELFTEST], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def test_mismatch_leaves_vllm_untouched(selftest):
    assert selftest["mismatch_installed"] is False and selftest["mismatch_untouched"]
    (msg,) = selftest["mismatch_messages"]
    assert msg.endswith(": BlockPool._maybe_evict_cached_block: parameter 'block' missing (takes self, blk, why)"), msg
    assert selftest["version_installed"] is True and selftest["version_status"] == ""
    assert selftest["version_messages"] == []


def test_install_idempotent_and_uninstall_restores(selftest):
    assert selftest["installed"] and selftest["n_patched"] == 8   # 7 engine methods, the connector factory
    assert selftest["again"], "a second install() changed the patches"
    assert selftest["hot_out"] == ["allocate_slots", "_maybe_evict_cached_block"], "per-call wrappers left in, detached"
    assert selftest["hot_in"], "an attach did not put the per-call wrappers back"
    assert selftest["copy_wraps_originals"], "a second module copy stacked wrappers"
    assert selftest["restored_by_copy"] and selftest["restored"]
    assert selftest["connector_restored"] and selftest["api_after_uninstall"] is False


def test_worker_connector_and_api_records(selftest):
    assert selftest["idle_bytes"] == 0, "records were sent with no agent"
    assert selftest["sends"] == [True, 0, True], "worker steps are not sent at most every FLUSH_EVERY_NS"
    assert selftest["later_head"] == [["thread", {"tid": selftest["my_tid"]}]]
    sent = collections.Counter(n for n, _ in selftest["records"])
    assert sent["kv_step2"] == 3 and sent["kv_store"] == 0, "not one kv_step2 record per Worker step"
    # the rows the agent stores (usermark.records expands each kv_step2 the same way)
    recs = [x for n, r in selftest["records"] for x in (kv_step_rows(r) if n == "kv_step2" else [(n, r)])]
    kinds = collections.Counter(n for n, _ in recs)
    assert kinds["hook_start"] == 1 and [r for n, r in recs if n == "hook_start"][0]["role"] == "worker"
    loads = [r for n, r in recs if n == "kv_load" and r["source"] == "connector:Connector"]
    stores = [r for n, r in recs if n == "kv_store"]
    # three steps: two layer waits, none, two (the last one's wait_for_save raised)
    assert [r["layer_waits"] for r in loads] == [2, 0, 2] and len(stores) == 3
    # the stores: from the first save_kv_layer, with those calls' count and time inside
    assert [r["layer_waits"] for r in stores] == [2, 0, 2]
    assert all(r["wait_ns"] >= 2_000_000 and r["t_end_ns"] - r["t_start_ns"] >= r["wait_ns"]
               for r in stores if r["layer_waits"])
    for r in loads:
        assert r["t_start_ns"] < r["t_issue_end_ns"] <= r["t_end_ns"]
        assert r["t_issue_end_ns"] - r["t_start_ns"] >= 2_000_000
    assert loads[0]["wait_ns"] >= 2_000_000 and loads[0]["t_end_ns"] > loads[0]["t_issue_end_ns"]
    assert [r["seq"] for r in loads] == [r["seq"] for r in stores]
    (api_rec,) = [r for n, r in recs if n == "kv_load" and r["source"] == "fileconnector"]
    assert api_rec["request"] == "req-7" and api_rec["blocks"] == 3 and api_rec["nbytes"] == 3 * 65536
    assert api_rec["t_end_ns"] - api_rec["t_start_ns"] == 1000
    assert selftest["own_error"] == "\"connector's own error\""  # the connector's exception, untouched
    assert selftest["errors"] == 1  # the bogus kv_transfer() call, counted, not raised
    assert kinds["hook_stats"] >= 1


def test_records_never_carry_token_ids():
    for name, fields in RECORDS.values():
        assert not any("token" in f and f not in ("total_tokens", "prefill_tokens", "decode_tokens", "num_tokens",
                                                  "output_tokens")   # counts, not ids
                       for f, _ in fields), name


@pytest.mark.root
def test_attach_keeps_the_plugins_hook(hooked_server, tmp_path):
    """`kvtrace attach --port` on a server whose plugin hook is active uses it (no second hook)
    and leaves it in place at detach: the plugin's hook is the server's, not the agent's."""
    from kvtrace.inject import injector

    srv = hooked_server.server
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(srv.port),
                             "--out", str(tmp_path / "ds")], stderr=subprocess.PIPE, text=True)
    lines = []
    while not any("vLLM hook" in line and "engine" in line for line in lines):
        line = proc.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)
    assert any("already active in engine" in line for line in lines), lines
    hooked_server.post(list(range(100, 400)), "keep-plugin-0")
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + rest
    engine = srv.processes()["engine"][0]
    state = injector.hook(engine, "status", module=VLLM_HOOK)
    assert state["status"]["installed"] is True, state
    from kvtrace.dataset.reader import Dataset

    steps = Dataset.open(tmp_path / "ds").table("step").to_pylist()
    assert steps and len({s["step"] for s in steps}) == len(steps)   # one hook: no step twice
