"""No tier against LMCache on one workload, compared by `kvtrace compare` and gated as a study
gates a KV tier (`make test-long`; README's "Run against run" shows its output).

Workload: 8 prompts of 1,000 tokens sent in order, twice.  vLLM's cache (122 blocks of 32
tokens: 3,904 tokens) holds about 4 of them, so the second pass finds none in vLLM's own cache:
BASE (no connector) recomputes every token; NEW (LMCache multiprocess mode, L1 in memory, an
`fs` L2) loads each prompt's 3 stored chunks (768 tokens) back.  Each run is attached by
`kvtrace attach --port`; the comparison's hit rates are checked against vLLM's own counters.
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer
from tests import helpers
from tests.helpers import wait_for
from tests.lmcache.conftest import CHUNK
from tests.vllm.conftest import free_port
from tests.vllm.test_hook import settled_metrics

pytestmark = [pytest.mark.root, pytest.mark.long]

REPO = Path(__file__).resolve().parents[2]
PROMPTS, LEN = 8, 1000
GATES = ("ttft_p50<=-25%", "output_tokens_per_s>=+29%")
EXTERNAL = "vllm:external_prefix_cache_hits_total"


def drive(srv, out: Path) -> dict:
    """Attach, send the workload, stop: the dataset and vLLM's external-hit count over it."""
    err = out.parent / f"{out.name}.stderr"
    agent = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(srv.port),
                              "--out", str(out)], stderr=open(err, "wb"), cwd=REPO)
    try:
        wait_for(lambda: agent.poll() is not None or "injected in engine" in err.read_text(errors="replace"),
                 180, "the hook's injection")
        time.sleep(1.2)
        m0 = settled_metrics(srv, (EXTERNAL,))
        rnd = random.Random(77)
        prompts = [workload.tokens(rnd, LEN) for _ in range(PROMPTS)]
        for rep in range(2):
            for i, p in enumerate(prompts):
                helpers.post_completion(srv.url, srv.model, p, f"p{rep}x{i}", max_tokens=16)
        m1 = settled_metrics(srv, (EXTERNAL,))
        time.sleep(1.5)
    finally:
        agent.send_signal(signal.SIGINT)
        assert agent.wait(180) == 0, err.read_text()[-3000:]
    return {"external": m1[EXTERNAL] - m0[EXTERNAL]}


def test_no_tier_against_lmcache(lmcache_server, lmcache_vllm, tmp_path, kvtrace_cli):
    base = VllmServer(args=["--block-size", "32", "--enable-prefix-caching", "--max-num-batched-tokens", "256",
                            "--num-gpu-blocks-override", "122", "--max-model-len", "2048"],
                      port=free_port(avoid=(lmcache_vllm.port,)), env={"VLLM_PLUGINS": ""}, workdir=tmp_path / "base")
    base.start()
    try:
        got_base = drive(base, tmp_path / "base-ds")
    finally:
        base.stop()
    got_new = drive(lmcache_vllm, tmp_path / "new-ds")
    assert got_base["external"] == 0 and got_new["external"] == PROMPTS * (LEN // CHUNK) * CHUNK
    p = kvtrace_cli("compare", str(tmp_path / "base-ds"), str(tmp_path / "new-ds"), "--json",
                    *(a for g in GATES for a in ("--gate", g)), timeout=600)
    assert p.returncode in (0, 8), p.stderr
    cmp = json.loads(p.stdout)
    fig = {f["figure"]: f for f in cmp["figures"]}
    # the hit rate by source as vLLM counted it: all of NEW's from the tier, none of BASE's
    assert (fig["hit_rate_storage"]["base"], fig["hit_rate_storage"]["new"]) == \
        (0, got_new["external"] / (2 * PROMPTS * LEN))
    assert fig["miss_evicted"]["new"] < fig["miss_evicted"]["base"]
    text = kvtrace_cli("compare", str(tmp_path / "base-ds"), str(tmp_path / "new-ds"),
                       *(a for g in GATES for a in ("--gate", g)), timeout=600)
    print(text.stdout, text.stderr)
    (tmp_path / "compare.txt").write_text(text.stdout + text.stderr)
    print(json.dumps(cmp, indent=1)[:4000])
