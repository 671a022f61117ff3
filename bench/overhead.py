"""kvtrace's cost to a real vLLM server, and the agent's own CPU and memory (needs root).

A real vLLM CPU server (tiny random-weight Llama, chunked prefill at 256 tokens, prefix
caching, 122 KV blocks, KV events, kvtrace's file KV connector, so KV blocks are stored to
and loaded back from files) serves a fixed shared-prefix workload at concurrency 4, in phases
interleaved A/B/A/B in one session, each phase 3 rounds back to back (1 in --short): A
untraced, B under one `kvtrace attach --port` (every probe this kernel has, the hook injected
live, KV events and /metrics recorded, Parquet written and OTLP streamed to a local
receiver).  The prefix cache is reset before every round.  Reported: tokens/s and TTFT p50
per phase, and B/A ratios of adjacent phases with their spread; during B phases the agent's CPU (per wall second) and RSS (psutil, sampled every 0.2 s, after
attach: the steady state).  Then the hook's cost per engine step, detached and attached, from
bench/hookstep.py in vLLM's interpreter under `kvtrace attach`.

    sudo .venv/bin/python bench/overhead.py [--short] [--json out.json]

Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllmbench import PY, ROOT, Agent, free_port, kvtrace_importable_env, one_round, requests, spread  # noqa: E402

from kvtrace.vllm.server import VllmServer, demo_args, vllm_python  # noqa: E402

SETTLE_S = 3.0


def start_server(work: Path) -> VllmServer:
    port = free_port()
    zport = free_port(avoid=(port,))
    args = demo_args(work, zport)   # the demo's server
    # no plugin: the hook gets in by live injection on each attach, and leaves on each detach
    env = {"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1", **kvtrace_importable_env()}  # the file connector
    return VllmServer(args=args, port=port, env=env, workdir=work).start()


def phase(server: VllmServer, reqs, concurrency: int, n: int) -> dict:
    """n rounds back to back (the agent, in B, attached across all of them): their totals."""
    rs = [one_round(server, reqs, concurrency) for _ in range(n)]
    wall = sum(r["wall_s"] for r in rs)
    return {"wall_s": round(wall, 3), "tokens": sum(r["tokens"] for r in rs),
            "tokens_per_s": sum(r["tokens"] for r in rs) / wall,
            "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in rs), "errors": sum(r["errors"] for r in rs),
            "cached_tokens": sum(r["cached_tokens"] for r in rs), "rounds": n}


def vllm_ab(short: bool) -> dict:
    pairs = 1 if short else 5
    per_phase = 1 if short else 3   # rounds per A or B phase: the steady state outweighs the attach
    concurrency = 4
    reqs = requests(short)
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-overhead-"))
    receiver = None
    try:
        from tests.otlp_receiver import Receiver

        receiver = Receiver().start()
    except Exception as e:  # OTLP export is then left out of B, and said
        print(f"overhead: no local OTLP receiver ({type(e).__name__}: {e}); B runs without --otlp", file=sys.stderr)
    server = start_server(work)
    rounds = []
    agent_cpu, agent_rss = [], []
    try:
        one_round(server, reqs, concurrency)                  # warm-up: compile, storage filled
        for i in range(pairs):
            for mode in ("A", "B"):
                agent = None
                if mode == "B":
                    agent = Agent(server, work / f"ds{i}", receiver.grpc_url if receiver else None)
                    time.sleep(SETTLE_S)          # past the first flushes: the steady state is measured
                    agent.sample()
                    c0 = agent.cpu()
                r = phase(server, reqs, concurrency, per_phase)
                if agent is not None:
                    agent_cpu.append((agent.cpu() - c0) / r["wall_s"])
                    agent._stop.set()
                    agent_rss += agent.rss
                    r["agent_rss_max_mib"] = round(max(agent.rss) / 2**20, 1) if agent.rss else None
                    agent.stop()
                    r["agent_exit"] = agent.proc.returncode
                    from kvtrace.dataset.reader import Dataset

                    (run,) = Dataset.open(work / f"ds{i}").runs()
                    r["events"] = sum(run["events"].values())
                    r["lost_events"] = run["lost_events"]
                r["mode"] = mode
                rounds.append(r)
                print(f"overhead: phase {len(rounds)} {mode}: {r['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                      f"{r['ttft_p50_s'] * 1000:.0f} ms", file=sys.stderr)
    finally:
        server.stop()
        if receiver is not None:
            receiver.stop()
    a = [r for r in rounds if r["mode"] == "A"]
    b = [r for r in rounds if r["mode"] == "B"]
    tps = [y["tokens_per_s"] / x["tokens_per_s"] for x, y in zip(a, b)]
    ttft = [y["ttft_p50_s"] / x["ttft_p50_s"] for x, y in zip(a, b)]
    mean_a = statistics.fmean(r["tokens_per_s"] for r in a)
    mean_b = statistics.fmean(r["tokens_per_s"] for r in b)
    for r in rounds:
        r["tokens_per_s"] = round(r["tokens_per_s"], 2)
        r["ttft_p50_s"] = round(r["ttft_p50_s"], 4)
    return {
        "requests": len(reqs), "concurrency": concurrency, "pairs": pairs, "rounds_per_phase": per_phase, "rounds": rounds,
        "otlp": receiver is not None,
        "tokens_per_s": {"A": round(mean_a, 2), "B": round(mean_b, 2)},
        "tokens_per_s_ratio": spread(tps), "ttft_p50_ratio": spread(ttft),
        "throughput_loss_pct": round((1 - statistics.fmean(tps)) * 100, 2),
        "errors": sum(r["errors"] for r in rounds),
        "agent_cpu_pct_of_core": spread([c * 100 for c in agent_cpu]),
        "agent_rss_mib": {"mean": round(statistics.fmean(agent_rss) / 2**20, 1), "max": round(max(agent_rss) / 2**20, 1)}
        if agent_rss else None,
        "load_average": round(os.getloadavg()[0], 2),
    }


def hook_cost(short: bool) -> dict:
    """bench/hookstep.py in vLLM's interpreter, under kvtrace attach (so 'attached' is real)."""
    with tempfile.TemporaryDirectory() as d:
        res = os.path.join(d, "hook.json")
        rounds = "3" if short else "15"
        p = subprocess.run([PY, "-m", "kvtrace", "attach", "--quiet", "--out", os.path.join(d, "ds"), "--",
                            vllm_python(), str(ROOT / "bench" / "hookstep.py"), "--rounds", rounds, "--json", res],
                           capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not os.path.exists(res):
            raise RuntimeError(f"hookstep failed ({p.returncode}): {p.stderr[-2000:]}")
        out = json.load(open(res))
        from kvtrace.dataset.reader import Dataset

        ds = Dataset.open(os.path.join(d, "ds"))
        out["steps_recorded"] = ds.table("step").num_rows if "step" in ds.names() else 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true", help="CI mode: one A/B pair on a small workload, 3 hook rounds")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--skip-vllm", action="store_true", help="only the hook's cost per step")
    a = ap.parse_args()
    if not os.path.exists(vllm_python()):
        result = {"skipped": f"no vLLM interpreter at {vllm_python()} (scripts/setup-vllm, or set KVTRACE_VLLM_PYTHON)"}
    else:
        result = {"hook": hook_cost(a.short)}
        if not a.skip_vllm:
            result["vllm"] = vllm_ab(a.short)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
