"""kvtrace attached to vLLM with async scheduling on, as a GPU engine runs it: AsyncScheduler and
EngineCore.step_with_batch_queue with a batch queue of 2, so step N+1 is scheduled before step
N's update_from_output (vllm/v1/engine/core.py) and a decode is scheduled while the request's
previous token is still being computed (output placeholders).

vLLM CPU does not run this by itself: CpuPlatform.check_and_update_config ends with
``scheduler_config.async_scheduling = False`` ("async scheduling is not required on CPU",
vllm/platforms/cpu.py, 0.32), which also leaves max_concurrent_batches at 1 (no batch queue),
whatever --async-scheduling says; --scheduler-cls ...AsyncScheduler alone runs AsyncScheduler
in the serial EngineCore.step; and --pipeline-parallel-size 2 with AsyncScheduler crashes the
V1 model runner (gpu_model_runner.py _update_states: IndexError).  So the server here gets a
sitecustomize (on PYTHONPATH, in the test's own directory) that keeps the value vLLM had
resolved before that platform hook: vLLM's own code then does the rest (AsyncScheduler, a
batch queue of 2: the log's "Batch queue is enabled with size 2", the model runner's async
output path).

Workload: 4 prompts of 600 tokens sharing a 512-token prefix, sent at once (chunked prefills of
a 256-token budget overlap the first request's decodes), 8 output tokens each (ignore_eos); then
one request that a stop token ends at its third output token, which AsyncScheduler cannot know
when it schedules the next step (that step's decode is computed and dropped).
"""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from tests import helpers
from tests.vllm.conftest import prefix_caching, served

pytestmark = [pytest.mark.root, pytest.mark.long]

BUDGET, BLOCK, OUT = 256, 32, 8
SHARED, TAIL, N = 512, 88, 4

# Keeps --async-scheduling on vLLM CPU: restores, after CpuPlatform.check_and_update_config,
# the async_scheduling value vLLM had resolved before it (True by default for this model).
SITECUSTOMIZE = '''\
import importlib.abc, importlib.machinery, sys


def _patch(mod):
    plat = mod.CpuPlatform
    orig = plat.__dict__["check_and_update_config"].__func__

    def check_and_update_config(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        orig(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True
            print("kvtrace-test: async scheduling kept on", file=sys.stderr, flush=True)

    plat.check_and_update_config = classmethod(check_and_update_config)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.platforms.cpu":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("async-scheduling")
    site = base / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    args = prefix_caching("--num-gpu-blocks-override", "122", "--async-scheduling", block=BLOCK, budget=BUDGET)
    with served(base, args, ports=(8350, 8399), env={"PYTHONPATH": str(site), "VLLM_LOGGING_LEVEL": "DEBUG"},
                timeout=900) as srv:
        yield scenario(srv, base)


def concurrently(srv, prompts: dict[str, list[int]], **extra) -> dict[str, dict]:
    out, errors = {}, []

    def one(name, prompt):
        try:
            out[name] = helpers.post_completion(srv.url, srv.model, prompt, name, max_tokens=OUT, **extra)
        except Exception as e:   # raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=item) for item in prompts.items()]
    for t in threads:
        t.start()
        time.sleep(0.02)   # in this order: the first one's prefill is in flight when the others arrive
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


def scenario(srv, base: Path) -> dict:
    rnd = random.Random(731)
    shared = workload.tokens(rnd, SHARED)
    prompts = {f"a{i}": shared + workload.tokens(rnd, TAIL) for i in range(N)}
    with helpers.Attached(srv.port, base / "ds"):
        sent = concurrently(srv, prompts, ignore_eos=True, return_token_ids=True)
        # a request ended by a stop token: a0's prompt again, stopping at the first output token
        # that differs from the ones before it (greedy: the same tokens come again)
        toks = sent["a0"]["choices"][0]["token_ids"]
        k = next(i for i in range(1, OUT) if toks[i] not in toks[:i])
        stop = helpers.post_completion(srv.url, srv.model, prompts["a0"], "stop", max_tokens=OUT,
                                       stop_token_ids=[toks[k]], return_token_ids=True)
        time.sleep(1.5)
    log = srv.log_path.read_text(errors="replace")
    return {"ds": Dataset.open(base / "ds"), "sent": sent, "stop": stop, "stop_at": k, "prompts": prompts,
            "log": log, "base": base}


def by_name(rows, col="request"):
    """Rows by the X-Request-Id each request was sent with (vLLM's id is cmpl-<it>-...)."""
    out = {}
    for r in rows:
        out.setdefault(r[col].split("-")[1], []).append(r)
    return out


def test_vllm_ran_the_overlapped_order(run):
    """What vLLM ran: async scheduling kept on, a batch queue of 2 (EngineCore.step_with_batch_queue,
    core.py: step_fn), and the hook's step spans overlap: step N's update_from_output ends
    after step N+1's schedule() returned."""
    assert "kvtrace-test: async scheduling kept on" in run["log"]
    assert "Batch queue is enabled with size 2" in run["log"]
    steps = sorted(run["ds"].table("step").to_pylist(), key=lambda s: s["step"])
    nums = [s["step"] for s in steps]
    assert len(nums) == len(set(nums))
    overlapped = [a["step"] for a, b in zip(steps, steps[1:])
                  if b["step"] == a["step"] + 1 and a["t_end_ns"] > b["t_sched_end_ns"]]
    assert len(overlapped) >= len(steps) // 2, (len(overlapped), len(steps))


def test_chunks_cover_each_prompt_once_with_vllms_cached_tokens(run):
    ds, sent = run["ds"], {**run["sent"], "stop": run["stop"]}
    chunks, admits = by_name(ds.table("chunk").to_pylist()), by_name(ds.table("admit").to_pylist())
    assert set(chunks) == set(admits) == set(sent)
    for name, resp in sent.items():
        usage = resp["usage"]
        (adm,) = admits[name]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert adm["cached_local"] == cached and adm["prompt_len"] == usage["prompt_tokens"] == SHARED + TAIL
        mine = sorted((c["start"], c["length"]) for c in chunks[name])
        assert mine[0][0] == cached
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))       # no gap, no overlap
        assert sum(n for _, n in mine) == usage["prompt_tokens"] - cached    # every token once
        assert sum(c["last"] for c in chunks[name]) == 1
    # the first request computed the shared prefix; the others hit at least its 16 blocks
    hits = sorted(s["usage"]["prompt_tokens_details"]["cached_tokens"] for s in run["sent"].values())
    assert hits[0] == 0 and all(h >= SHARED for h in hits[1:])


def test_each_step_is_one_schedulers_output(run):
    ds = run["ds"]
    steps = {s["step"]: s for s in ds.table("step").to_pylist()}
    chunks = ds.table("chunk").to_pylist()
    per_step: dict[int, int] = {}
    for c in chunks:
        assert c["step"] in steps, c
        per_step[c["step"]] = per_step.get(c["step"], 0) + c["length"]
    for n, s in steps.items():
        assert s["prefill_tokens"] == per_step.get(n, 0) <= BUDGET
        assert s["prefill_reqs"] == sum(1 for c in chunks if c["step"] == n)
        # (a decode computed and dropped is in total_tokens, not in decode_tokens: the analyze test)
        assert s["prefill_tokens"] + s["decode_tokens"] <= s["total_tokens"] <= BUDGET
    finishes = by_name(ds.table("finish").to_pylist())
    assert {k: len(v) for k, v in finishes.items()} == {name: 1 for name in [*run["sent"], "stop"]}


def test_analyze_counts_the_requests_output_tokens(run, kvtrace_cli):
    """The ignore_eos requests end at max_tokens, which AsyncScheduler sees coming (it schedules
    no decode past it); the stop request's stop token is not, so the step scheduled before its
    update computes one more decode for it, which vLLM drops ("already finished").  Output
    tokens are what the 5 requests got."""
    p = kvtrace_cli("analyze", str(run["ds"].root), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    got = rep["service"]["output_tokens"]
    want = sum(s["usage"]["completion_tokens"] for s in run["sent"].values()) + run["stop"]["usage"]["completion_tokens"]
    assert run["stop"]["usage"]["completion_tokens"] == run["stop_at"] + 1 < OUT
    assert rep["service"]["requests"] == N + 1
    # computed: every step's tokens past its prefill chunks, and each request's first token
    steps = run["ds"].table("step").to_pylist()
    firsts = sum(c["last"] for c in run["ds"].table("chunk").to_pylist())
    computed = sum(s["total_tokens"] - s["prefill_tokens"] for s in steps) + firsts
    assert computed - want == 1, (computed, want)   # the stop request's dropped decode
    assert sum(s["decode_tokens"] for s in steps) + firsts == want
    assert got == want, f"analyze counts {got} output tokens, the requests got {want}"
