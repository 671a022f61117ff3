"""`kvtrace analyze` and `kvtrace whatif` against a real vLLM CPU server.

One shared-prefix workload (kvtrace.demo.workload, sequential, seed fixed) runs twice, with
the agent attached, at two settings:
  A  chunk budget 256 tokens, 640 KV blocks: nothing is evicted, the first prompt hits in full when repeated
  B  chunk budget 512 tokens,  90 KV blocks: evictions, and the repeat misses
For each, kvtrace's token-weighted hit rate must equal vLLM's own (sum of `cached_tokens` over
sum of `prompt_tokens` in its responses) within 0.5 points.  Before B runs, `whatif` predicts B
from A's dataset; B's measured hit rate must be within 2 points and its evictions (the hook's
evict records, which equal vLLM's BlockRemoved events: tests/vllm/test_hook.py) within 10%.
The HTML report of A is opened in headless Chromium and its screenshot checked for the plots.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer

from .conftest import free_port, vllm_skip_reason
from .test_hook import Agent, metric_sum
from tests.unit.analysis_fixture import png_pixels

REPO = Path(__file__).resolve().parents[2]
BASE = ["--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "2048"]
SETTINGS = {"A": {"chunk": 256, "blocks": 640}, "B": {"chunk": 512, "blocks": 90}}
METRICS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")


def requests() -> list[workload.Request]:
    return workload.shared_prefix(seed=6, groups=4, per_group=3, prefix_len=640, suffix_len=360, fillers=3,
                                  filler_len=1000, max_tokens=8)


def run_setting(name: str, out: Path, workdir: Path) -> dict:
    s = SETTINGS[name]
    srv = VllmServer(args=[*BASE, "--max-num-batched-tokens", str(s["chunk"]), "--num-gpu-blocks-override", str(s["blocks"])],
                     port=free_port(8500, 8599), workdir=workdir)
    srv.start()
    try:
        procs = srv.processes()
        agent = Agent([*procs["engine"], *procs["workers"]], out)
        try:
            agent.wait_attached()
            time.sleep(1.2)  # the hook re-reads the agent flag at most once per second
            m0 = srv.metrics()
            results = workload.run(srv.url, srv.model, requests())
            time.sleep(0.5)
            m1 = srv.metrics()
            time.sleep(1.5)
        finally:
            rc = agent.stop()
        assert rc == 0, agent.err.read_text()[-2000:]
    finally:
        srv.stop()
    assert not [r.error for r in results if r.error], [r.error for r in results if r.error]
    return {"results": results, "metrics": {k: metric_sum(m1, k) - metric_sum(m0, k) for k in METRICS}}


def analyze(ds: Path, *extra) -> dict:
    r = subprocess.run([sys.executable, "-m", "kvtrace", "analyze", str(ds), "--json", *extra], capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("analysis")
    out = {"dir": base}
    out["A"] = run_setting("A", base / "dsA", base / "vllmA")
    sa = SETTINGS["B"]
    r = subprocess.run([sys.executable, "-m", "kvtrace", "whatif", str(base / "dsA"), "--json", "--chunk-size",
                        f"{SETTINGS['A']['chunk']},{sa['chunk']}", "--cache-blocks", f"{SETTINGS['A']['blocks']},{sa['blocks']}"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    out["whatif"] = json.loads(r.stdout)
    out["B"] = run_setting("B", base / "dsB", base / "vllmB")
    return out


def vllm_rate(results) -> tuple[float, int, int]:
    cached = sum(r.cached_tokens for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    return cached / prompt, cached, prompt


@pytest.mark.root
@pytest.mark.parametrize("setting", ["A", "B"])
def test_hit_rate_equals_vllm(runs, setting):
    res = runs[setting]
    rate, cached, prompt = vllm_rate(res["results"])
    assert all(r.completion_tokens == 8 for r in res["results"])
    rep = analyze(runs["dir"] / f"ds{setting}")
    reuse = rep["reuse"]
    print(f"setting {setting}: kvtrace {reuse['hit_tokens']}/{reuse['prompt_tokens']} = {100 * reuse['hit_rate']:.3f}%, "
          f"vLLM responses {cached}/{prompt} = {100 * rate:.3f}%, /metrics {res['metrics']}, "
          f"evictions {rep['chunking']['evictions']['evictions']}, bottleneck {rep['verdict']['bottleneck']}")
    assert reuse["requests"] == len(res["results"])
    assert abs(100 * reuse["hit_rate"] - 100 * rate) <= 0.5
    assert reuse["prompt_tokens"] == prompt
    # /metrics: the local prefix cache counters rise by exactly the first admissions' local hits here
    # (no KV connector, every request seen by the hook); the report explains any difference
    m = res["metrics"]
    assert m["vllm:prefix_cache_queries_total"] == prompt
    assert m["vllm:prefix_cache_hits_total"] == reuse["hit_local"]
    if setting == "B":
        assert rep["chunking"]["evictions"]["evictions"] > 0, "the workload did not evict"
    assert rep["reuse"]["by_chunk_index"][0]["chunk_index"] == 0
    assert all(x["hit"] == 0 for x in rep["reuse"]["by_chunk_index"][1:]), "a later chunk was counted as a hit"
    # no KV connector: nothing is read back, so no chunk waits on storage; one request at a time,
    # so a chunk hardly queues: the model's compute bounds every chunk
    timing = rep["timing"]
    assert timing["components_ns"]["storage"] == 0 and timing["shares"]["storage"] == 0, timing
    assert timing["shares"]["compute"] > timing["shares"]["queueing"], timing
    assert rep["verdict"]["bottleneck"] == "compute", rep["verdict"]


@pytest.mark.root
def test_whatif_predicts_b_from_a(runs):
    wi = runs["whatif"]
    pred = {(p["chunk_size"], p["cache_blocks"]): p for p in wi["predictions"]}
    a, b = SETTINGS["A"], SETTINGS["B"]
    pa, pb = pred[(a["chunk"], a["blocks"])], pred[(b["chunk"], b["blocks"])]
    rep_b = analyze(runs["dir"] / "dsB")
    rate_b, _, _ = vllm_rate(runs["B"]["results"])
    ev_b = rep_b["chunking"]["evictions"]["evictions"]
    rec = wi["recorded"]
    print(f"whatif from A: replay of A {100 * pa['hit_rate']:.2f}% / {pa['evictions']} evictions "
          f"(recorded {100 * rec['hit_rate']:.2f}% / {rec['evictions']}); predicted B {100 * pb['hit_rate']:.2f}% / "
          f"{pb['evictions']} evictions; measured B {100 * rate_b:.2f}% / {ev_b}")
    assert rec["cache_blocks"] == a["blocks"] and rec["block_size"] == 32
    assert abs(100 * pb["hit_rate"] - 100 * rate_b) <= 2.0
    assert ev_b > 0 and abs(pb["evictions"] - ev_b) <= 0.10 * ev_b
    # the replay of the recorded setting reproduces the recording
    assert abs(100 * pa["hit_rate"] - 100 * rec["hit_rate"]) <= 2.0
    assert abs(pa["evictions"] - rec["evictions"]) <= 0.10 * max(rec["evictions"], 1)


@pytest.mark.root
def test_html_report_renders_in_chromium(runs, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    page = tmp_path / "report.html"
    r = subprocess.run([sys.executable, "-m", "kvtrace", "analyze", str(runs["dir"] / "dsA"), "--html", str(page)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    text = page.read_text()
    assert text.count("<svg") >= 5 and not re.search(r"<script|\b(src|href)\s*=|https?://(?!www\.w3\.org/2000/svg)", text)
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    w, h, px = png_pixels(shot)
    assert (w, h) == (1280, 2400)
    counts = {}
    for p in px:
        counts[p] = counts.get(p, 0) + 1
    compute = counts.get(bytes.fromhex("4e79a7"), 0)   # compute bars (timeline, time split)
    hits = counts.get(bytes.fromhex("59a14f"), 0)      # hit-rate bars
    white = counts.get(b"\xff\xff\xff", 0)
    print(f"screenshot {shot}: {w}x{h}, compute-blue {compute} px, hit-green {hits} px, white {white} px")
    assert compute > 2000 and hits > 500, "the plots did not render"
    assert white < 0.97 * w * h
