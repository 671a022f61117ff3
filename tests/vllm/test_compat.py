"""Each vLLM release the hook supports, proven live on a real server of that release.

For every release in $KVTRACE_COMPAT (``make compat`` gives 0.28.0 0.30.0 0.31.0 0.32.0; marked
``matrix``, so ``make test`` leaves it out: 0.32.0 is the rest of the suite's), a server with kvtrace's file connector
and no plugin is attached to live (the hook injected), driven through prefix hits, chunked
prefill, evictions, a preemption and loads back from the files, and checked against that
release's own answers: cached tokens in its responses, chunk ranges tiling every admission,
evicted hashes against its BlockRemoved stream, preemptions against its /metrics, and the
connector's load bytes against the kernel's file reads.  A second server loads the hook from
the plugin entry point at start.  Each release's venv is scripts/setup-vllm VERSION's.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.hook.state import HOOK_VERSION
from kvtrace.demo.server import TINY_LLAMA, VllmServer, release_python
from tests import helpers
from tests.vllm.conftest import BLOCK_SIZE, SERVER_ARGS, KvEventSink, free_port
from tests.vllm.test_hook import settled_metrics
from tests.vllm.test_inject import Agent
from tests.vllm_checks import check_evictions, check_requests, removed_hashes

pytestmark = [pytest.mark.root, pytest.mark.matrix]

RELEASES = os.environ.get("KVTRACE_COMPAT", "0.28.0").replace(",", " ").split()
METRICS = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
BLOCK_BYTES = TINY_LLAMA["num_hidden_layers"] * 2 * TINY_LLAMA["num_key_value_heads"] * BLOCK_SIZE * HEAD_DIM * 2
READS = ("read", "pread64", "readv", "preadv", "preadv2")
SUMMARY_DIR = Path(os.environ.get("KVTRACE_COMPAT_OUT", "/var/cache/kvtrace/compat"))


def skip_reason(version: str) -> str | None:
    py = release_python(version)
    if not Path(py).exists():
        return f"needs vLLM {version}'s venv ({py}): bash scripts/setup-vllm {version}"
    probe = ("import importlib.util, sys, vllm; sys.exit(0 if vllm.__version__ == sys.argv[1] and "
             "importlib.util.find_spec('kvtrace') else 3)")
    r = subprocess.run([py, "-c", probe, version], capture_output=True, timeout=120)
    if r.returncode:
        return f"{py} is not vLLM {version} with kvtrace installed: bash scripts/setup-vllm {version}"
    return None


@pytest.fixture(params=RELEASES)
def release(request) -> str:
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("zmq", reason="needs pyzmq in kvtrace's venv to read vLLM's KV events")
    return request.param


def start(version: str, work: Path, plugin: bool, zport: int) -> VllmServer:
    connector = {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
                 "kv_connector_extra_config": {"path": str(work / "blocks"), "stats_dir": str(work / "stats")}}
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    env = {"VLLM_SERVER_DEV_MODE": "1"} | ({} if plugin else {"VLLM_PLUGINS": ""})
    server = VllmServer(args=[*SERVER_ARGS, "--kv-events-config", json.dumps(kv),
                              "--kv-transfer-config", json.dumps(connector)],
                        python=release_python(version), port=free_port(8100, 8179, avoid=(zport,)), env=env,
                        workdir=work / "server")
    return server.start()


def burst(server: VllmServer, n: int = 3) -> dict[str, dict]:
    """n 1,000-token prompts generating 1,000 tokens each, queued while the scheduler is paused:
    any two outgrow the 121-block cache while decoding, so one is preempted."""
    rnd = __import__("random").Random(20261206)
    out: dict[str, dict] = {}

    def one(name: str, prompt: list[int]) -> None:
        out[name] = helpers.post_completion(server.url, server.model, prompt, name, max_tokens=1000, ignore_eos=True)

    threads = [threading.Thread(target=one, args=(f"burst{i}", workload.tokens(rnd, 1000))) for i in range(n)]
    helpers.dev_post(server.url, "/pause?mode=keep&clear_cache=false")
    try:
        for t in threads:
            t.start()
            time.sleep(0.05)
        time.sleep(2.0)
    finally:
        helpers.dev_post(server.url, "/resume")
    for t in threads:
        t.join(300)
    return out


def check_tiling(ds) -> int:
    """The chunks of every admission (first or after a preemption) tile its prefill, in order,
    from the admission's first uncached token."""
    admits = {(a["request"], a["attempt"]): a for a in ds.table("admit").to_pylist()}
    per = collections.defaultdict(list)
    for c in ds.table("chunk").to_pylist():
        per[(c["request"], c["attempt"])].append(c)
    assert set(per) == set(admits), "chunks without an admission, or an admission without chunks"
    for key, cs in per.items():
        cs.sort(key=lambda c: c["chunk_index"])
        a = admits[key]
        assert [c["chunk_index"] for c in cs] == list(range(len(cs))), key
        assert cs[0]["start"] == a["start"] and cs[-1]["start"] + cs[-1]["length"] == a["prefill_len"], key
        assert all(x["start"] + x["length"] == y["start"] for x, y in zip(cs, cs[1:])), key
    return len(admits)


def check_loads(ds, worker: int, blocks: Path, stats: Path) -> int:
    """The connector's load bytes: its kv_load rows = the kernel's reads of its block files by
    the Worker = its own counters."""
    loads = [r for r in ds.table("kv_load").to_pylist() if r["source"] == "kvtrace-file"]
    hooked = sum(r["nbytes"] for r in loads)
    io = [r for r in ds.table("file_io").to_pylist()
          if r["pid"] == worker and r["syscall"] in READS and r["path"].startswith(str(blocks) + "/")
          and not r["path"].endswith("layout.json")]
    assert all(r["weight"] == 1 for r in io), "file reads were sampled"
    kernel = sum(r["bytes"] for r in io)
    own = json.loads((stats / "worker.json").read_text())
    assert hooked == kernel == own["load_bytes"] > 0, (hooked, kernel, own)
    assert hooked == sum(r["blocks"] for r in loads) * BLOCK_BYTES
    return kernel


def test_live_injection_against_the_release(release, tmp_path):
    zport = free_port(8180, 8199)
    events = KvEventSink(zport).start()
    server = start(release, tmp_path, plugin=False, zport=zport)
    try:
        out = tmp_path / "ds"
        agent = Agent(server, out)
        try:
            assert any("injected in engine" in line for line in agent.lines), agent.lines
            t0 = agent.t_attached
            time.sleep(1.2)   # the hook re-reads the agent's flag once a second, at a step
            m0 = settled_metrics(server, METRICS)
            reqs = workload.shared_prefix(seed=26, groups=3, per_group=3, prefix_len=640, suffix_len=360, fillers=3)
            results = workload.run(server.url, server.model, reqs)
            bursts = burst(server)
            time.sleep(1.0)
            m1 = settled_metrics(server, METRICS)
            t1 = time.monotonic_ns()
        finally:
            assert agent.stop() == 0, agent.lines
        assert not any(r.error for r in results), [r.error for r in results if r.error]
        ds = Dataset.open(out)
        run = ds.runs()[-1]
        assert sum(run["lost_events"].values()) == 0 and run["dropped_events"] == 0, run
        engine, worker = server.processes()["engine"][0], server.processes()["workers"][0]
        starts = {h["role"]: h["vllm_version"] for h in ds.table("hook_start").to_pylist()}
        assert starts == {"engine": release, "worker": release}, starts
        assert all(s["errors"] == 0 and s["dropped"] == 0 for s in ds.table("hook_stats").to_pylist())

        reqs_ok = check_requests(ds, results)
        admits = check_tiling(ds)
        evicted = check_evictions(ds, removed_hashes(events.between(t0, t1)))
        preempts = ds.table("preempt").to_pylist()
        assert preempts and len(preempts) == m1["vllm:num_preemptions_total"] - m0["vllm:num_preemptions_total"]
        again = next(a for a in ds.table("admit").to_pylist() if a["request"].startswith("cmpl-again-g0-r0-"))
        assert again["cached_external"] > 0, again
        loaded = check_loads(ds, worker, tmp_path / "blocks", tmp_path / "stats")
        for name, resp in bursts.items():
            (a,) = [x for x in ds.table("admit").to_pylist() if x["request"].startswith(f"cmpl-{name}-") and x["attempt"] == 0]
            # (vLLM before about 0.21 leaves prompt_tokens_details null when nothing was cached)
            cached = (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert a["cached_local"] + a["cached_external"] == cached
        summary = {"release": release, **reqs_ok, "admissions": admits, "evictions": evicted,
                   "preemptions": len(preempts), "external_hit_tokens": again["cached_external"],
                   "loaded_bytes": loaded, "engine": engine}
    finally:
        server.stop()
        events.close()
    print("compat:", json.dumps(summary))
    SUMMARY_DIR.mkdir(parents=True, exist_ok=True)
    (SUMMARY_DIR / f"{release}-live.json").write_text(json.dumps(summary) + "\n")


def test_plugin_at_start_against_the_release(release, tmp_path):
    zport = free_port(8180, 8199)
    events = KvEventSink(zport).start()
    server = start(release, tmp_path, plugin=True, zport=zport)
    try:
        log = server.log_path.read_text(errors="replace")
        assert f"kvtrace hook {HOOK_VERSION} installed (engine+worker)" in log and \
            f"kvtrace hook {HOOK_VERSION} installed (worker)" in log
        out = tmp_path / "ds"
        agent = Agent(server, out)
        try:
            assert any("already active in engine" in line for line in agent.lines), agent.lines
            t0 = agent.t_attached
            time.sleep(1.2)
            reqs = workload.shared_prefix(seed=27, groups=2, per_group=2, prefix_len=640, suffix_len=360, fillers=3)
            results = workload.run(server.url, server.model, reqs)
            time.sleep(1.0)
            t1 = time.monotonic_ns()
        finally:
            assert agent.stop() == 0, agent.lines
        ds = Dataset.open(out)
        reqs_ok = check_requests(ds, results)
        check_tiling(ds)
        evicted = check_evictions(ds, removed_hashes(events.between(t0, t1)))
        loaded = check_loads(ds, server.processes()["workers"][0], tmp_path / "blocks", tmp_path / "stats")
        summary = {"release": release, **reqs_ok, "evictions": evicted, "loaded_bytes": loaded}
    finally:
        server.stop()
        events.close()
    print("compat plugin:", json.dumps(summary))
    SUMMARY_DIR.mkdir(parents=True, exist_ok=True)
    (SUMMARY_DIR / f"{release}-plugin.json").write_text(json.dumps(summary) + "\n")
