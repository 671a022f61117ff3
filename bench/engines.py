"""The study's question on both engines: one shared-prefix workload on vLLM and on SGLang, each
at two chunk sizes, with kvtrace attached; the figures `kvtrace analyze` gives for each run,
and `kvtrace compare` of the two engines at each chunk size (`make engines`, as root).

Workload: 6 groups of 4 requests; a group's requests share a 768-token prefix and add 96 tokens
of their own; within a group they are sent together (so the later ones arrive while the prefix
is still being computed in chunks), the groups one after another.  4 output tokens each.
Caches large enough that nothing is evicted (vLLM: 1,000 blocks of 32 tokens; SGLang: 32,000
tokens, page size 1), so every miss is about chunking and timing.

    python bench/engines.py [--chunks 200,512] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtrace.demo.server import VllmServer  # noqa: E402
from kvtrace.demo.sglang_server import SglangServer  # noqa: E402

GROUPS, PER_GROUP, PREFIX, OWN, GAP_S = 6, 4, 768, 96, 0.0
STUB = str(REPO / "tests" / "sglang" / "stub")


def prompts(seed: int = 3) -> list[list[list[int]]]:
    rnd = random.Random(seed)
    new = lambda n: [rnd.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    return [[p + new(OWN) for _ in range(PER_GROUP)] for p in (new(PREFIX) for _ in range(GROUPS))]


def server(engine: str, chunk: int, work: Path):
    if engine == "vllm":
        return VllmServer(args=["--block-size", "32", "--enable-prefix-caching", "--max-num-batched-tokens", str(chunk),
                                "--max-num-seqs", "16", "--num-gpu-blocks-override", "1000", "--max-model-len", "2048",
                                "--enable-prompt-tokens-details"], env={"VLLM_PLUGINS": ""}, workdir=work)
    return SglangServer(args=["--chunked-prefill-size", str(chunk), "--max-total-tokens", "32000"], workdir=work,
                        stub=STUB, env={"SGLANG_PLUGINS": "none"})


def send(srv, engine: str, ids: list[int], rid: str) -> int:
    """One request; the cached tokens the engine itself reports."""
    if engine == "vllm":
        r = srv.complete(ids, max_tokens=4)
        return int(((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return int(srv.generate(ids, max_new_tokens=4, rid=rid)["meta_info"]["cached_tokens"])


def drive(srv, engine: str) -> tuple[int, int]:
    cached, total = [0], 0
    lock = threading.Lock()
    for g, group in enumerate(prompts()):
        threads = []
        for i, ids in enumerate(group):
            def one(ids=ids, rid=f"g{g}r{i}"):
                c = send(srv, engine, ids, rid)
                with lock:
                    cached[0] += c
            t = threading.Thread(target=one)
            t.start()
            threads.append(t)
            total += len(ids)
            time.sleep(GAP_S)
        for t in threads:
            t.join(600)
    return cached[0], total


def run_one(engine: str, chunk: int, out: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"kvtrace-{engine}-"))
    srv = server(engine, chunk, work)
    srv.start()
    ds = out / f"{engine}-c{chunk}"
    shutil.rmtree(ds, ignore_errors=True)
    err = open(out / f"{ds.name}.stderr", "wb")
    agent = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(srv.port),
                              "--out", str(ds)], stderr=err, cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while "hook injected in engine" not in (out / f"{ds.name}.stderr").read_text(errors="replace"):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((out / f"{ds.name}.stderr").read_text()[-2000:])
            time.sleep(0.2)
        time.sleep(1.5)
        cached, total = drive(srv, engine)
        time.sleep(1.0)
    finally:
        agent.send_signal(signal.SIGINT)
        agent.wait(180)
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    rep = json.loads(subprocess.run([sys.executable, "-m", "kvtrace", "analyze", str(ds), "--json"], check=True,
                                    capture_output=True, text=True, cwd=REPO).stdout)
    return {"engine": engine, "chunk": chunk, "dataset": str(ds), "engine_hit_rate": cached / total, "report": rep}


def row(r: dict) -> dict:
    rep = r["report"]
    c, m = rep["chunking"], rep["misses"]
    return {"engine": r["engine"], "chunk": r["chunk"], "hit_rate": rep["reuse"]["hit_rate"],
            "engine_hit_rate": r["engine_hit_rate"], "inflight_missed": c["inflight"]["missed_tokens"],
            "mid_block_ends": c["partial_blocks"]["mid_block_ends"], "partial_tokens": c["partial_blocks"]["partial_tokens"],
            "ttft_p50_ms": (rep["service"]["ttft_p50_ns"] or 0) / 1e6,
            "causes": {k: v for k, v in m["first"].items() if v}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="200,512")
    ap.add_argument("--out", default="/var/cache/kvtrace/engines")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = [int(x) for x in a.chunks.split(",")]
    runs = [run_one(e, c, out) for c in chunks for e in ("vllm", "sglang")]
    rows = [row(r) for r in runs]
    print(f"{'engine':8} {'chunk':>5} {'hit rate':>9} {'(engine)':>9} {'in flight':>9} {'mid-block':>9} "
          f"{'TTFT p50 ms':>11}  miss causes")
    for x in rows:
        print(f"{x['engine']:8} {x['chunk']:>5} {100 * x['hit_rate']:8.2f}% {100 * x['engine_hit_rate']:8.2f}% "
              f"{x['inflight_missed']:>9,} {x['mid_block_ends']:>9} {x['ttft_p50_ms']:>11.1f}  "
              + ", ".join(f"{k.removeprefix('miss_')} {v:,}" for k, v in x["causes"].items()))
    (out / "engines.json").write_text(json.dumps(rows, indent=1))
    for c in chunks:
        subprocess.run([sys.executable, "-m", "kvtrace", "compare", str(out / f"vllm-c{c}"), str(out / f"sglang-c{c}")],
                       cwd=REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
