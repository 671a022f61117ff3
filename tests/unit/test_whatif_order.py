"""`kvtrace whatif` at the recorded setting gives the recorded run back, order preserved, on
recorded-style records of closed-loop clients under load (docs/analysis.md, "The replay's
order"); at other settings the closed-loop clients are replayed as before.

The records, for vLLM (32-token blocks, 96-token prompts, one output token) and for SGLang (page
size 1, 8-token prompts, two output tokens), a cache that holds one prompt:

  R1  prompt P, arrives at 1 s, runs in step 1 (1 ms)
  M   prompt P again, sent 10 ms after R1 finished (a closed-loop client): hits P
  U   prompt Q, sent 138 ms after M finished (a client that thought longer): evicts P
  V   prompt W at 3 s, in a step that took 1 s (the machine under load)

The step model fitted to these steps (a quarter of them 1 s long) makes R1's step last about
250 ms in the replay; M, replayed closed-loop 10 ms after R1's replayed finish, would then come
after U (kept at its recorded time, 150 ms after R1's), which evicts P first: M would miss what
it hit.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvtrace.analysis import whatif
from kvtrace.dataset import schema
from tests.unit import analysis_fixture as fx

MS = 1_000_000
# request -> (arrival ms, -, its prefill step's start and end ms)
PLAN = {"R1": (1000, 1, 1000, 1001), "M": (1011, 2, 1011, 1012), "U": (1150, 3, 1150, 1151),
        "V": (3000, 4, 3000, 4000)}
PROMPT = {"R1": "P", "M": "P", "U": "Q", "V": "W"}


def token_chain(name: str, n: int) -> list[int]:
    return [int.from_bytes(hashlib.sha256(f"{name}{i}".encode()).digest()[:8], "big") for i in range(n)]


def step(k: int, t0: float, t1: float, prefill: int, decode: int, free: int) -> dict:
    return fx.hook({"step": k, "t_start_ns": int(t0 * MS), "t_sched_end_ns": int(t0 * MS), "t_end_ns": int(t1 * MS),
                    "num_reqs": 1, "total_tokens": prefill + decode, "prefill_reqs": 1 if prefill else 0,
                    "prefill_tokens": prefill, "decode_reqs": decode, "decode_tokens": decode,
                    "new_reqs": 1 if prefill else 0, "resumed_reqs": 0, "preempted": 0, "evicted": 0,
                    "alloc_failures": 0, "running": 1, "waiting": 0, "free_blocks": free, "finished": 0})


def recording(root: Path, engine: str) -> tuple[Path, float]:
    """The records of the run above; and its recorded hit rate.  On SGLang each request also
    decodes a token (a step of 1 ms) before it finishes: its finish record comes at the end of
    that step, vLLM's in the next step's output."""
    sglang = engine == "sglang"
    bs, plen, cache = (1, 8, 12) if sglang else (32, 96, 4)
    hit = plen - 1 if sglang else 64        # M's hit: at most plen - 1 tokens, or the 2 full blocks before the last
    free = cache if sglang else cache - 1   # SGLang's free slots; vLLM's free blocks (the null block aside)
    chains = {p: token_chain(p, plen // bs) for p in "PQW"}
    rows = {t: [] for t in ("prompt_blocks", "arrive", "admit", "chunk", "step", "finish")}
    k = 0
    for r, (arr, _, t0, t1) in PLAN.items():
        local = hit if r == "M" else 0
        k += 1
        rows["prompt_blocks"].append(fx.hook({"step": k, "request": r, "block_size": bs, "prompt_len": plen,
                                              "max_output": 2 if sglang else 1, "num_blocks": plen // bs, "first": 0,
                                              "hashes": chains[PROMPT[r]]}))
        rows["arrive"].append(fx.hook({"step": k, "t_ns": arr * MS, "request": r, "traceparent": "", "tracestate": ""}))
        rows["admit"].append(fx.admit(k, r, plen, local, hit_blocks=local // bs))
        rows["chunk"].append(fx.chunk(k, r, local, plen - local, plen, 0, True))
        rows["step"].append(step(k, t0, t1, plen - local, 0, free))
        if sglang:   # its second token, then the finish record of that step
            k += 1
            rows["step"].append(step(k, t1, t1 + 1, 0, 1, free))
            rows["finish"].append(fx.hook({"step": k, "t_ns": (t1 + 1) * MS, "request": r}))
        else:
            rows["finish"].append(fx.hook({"step": k + 1, "t_ns": t1 * MS, "request": r}))
    for t, rs in rows.items():
        fx.write(root, t, rs)
    if sglang:
        fx.write(root, "engine", [fx.hook({"t_ns": 0, "name": "sglang", "version": "0.5.23", "block_size": 1})])
    fx.write(root, "runs", [fx.run_row(server_kind=engine, server_version="0.5.23" if sglang else "0.32.0")],
             sch=schema.RUNS)
    return root, hit / (4 * plen)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_recorded_setting_gives_the_recorded_run_back(tmp_path, engine):
    root, recorded = recording(tmp_path / engine, engine)
    res = whatif.run(root)
    (p,) = res["predictions"]
    rec = res["recorded"]
    assert (p["chunk_size"], p["block_size"], p["cache_blocks"]) == (rec["chunk_size"], rec["block_size"],
                                                                     rec["cache_blocks"])
    assert rec["hit_rate"] == pytest.approx(recorded)
    # M hits P before U evicts it, as recorded; and the replay keeps the recorded time
    assert p["hit_rate"] == pytest.approx(recorded) and p["hit_local"] == recorded * rec["prompt_tokens"]
    assert p["evictions"] > 0
    assert p["ttft_p50_ns"] == 1 * MS


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_other_settings_replay_the_closed_loop_clients(tmp_path, engine):
    """Away from the recorded setting the step model and the closed-loop re-timing decide: here
    the replayed clock runs slower than the recorded one and M comes back after U: with the
    recorded cache (one prompt) and twice the chunk budget, U evicts P before M; a cache of two
    prompts keeps it."""
    root, recorded = recording(tmp_path / engine, engine)
    rec = whatif.run(root)["recorded"]
    one, two = rec["cache_blocks"], 30 if engine == "sglang" else 8
    res = whatif.run(root, chunk_sizes=[2 * rec["chunk_size"]], cache_blocks=[one, two])
    p = {r["cache_blocks"]: r for r in res["predictions"]}
    assert p[one]["hit_local"] == 0
    assert p[two]["hit_rate"] == pytest.approx(recorded)
    assert any("1 of 4 requests replayed closed-loop" in n for n in whatif.run(root)["notes"])
