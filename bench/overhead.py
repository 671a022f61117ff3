"""kvtrace's cost to a real vLLM server, and the agent's own CPU and memory (needs root).

A real vLLM CPU server (tiny random-weight Llama, chunked prefill at 256 tokens, prefix
caching, 122 KV blocks, KV events, kvtrace's file KV connector, so KV blocks are stored to
and loaded back from files) serves a fixed shared-prefix workload at concurrency 4, in rounds
interleaved A/B/A/B in one session: A untraced, B under `kvtrace attach --port` (every probe
this kernel has, the hook injected live, KV events and /metrics recorded, Parquet written and
OTLP streamed to a local receiver).  The prefix cache is reset before every round.  Reported:
tokens/s and TTFT p50 per round, and B/A ratios of adjacent pairs with their spread; during B
rounds the agent's CPU (per wall second) and RSS (psutil, sampled every 0.2 s, after
attach: the steady state).  Then the hook's cost per engine step, detached and attached, from
bench/hookstep.py in vLLM's interpreter under `kvtrace attach`.

    sudo .venv/bin/python bench/overhead.py [--short] [--json out.json]

Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtrace.vllm import workload  # noqa: E402
from kvtrace.vllm.server import VllmServer, vllm_python  # noqa: E402

PY = sys.executable
PORTS = range(8600, 8700)
SETTLE_S = 3.0


def free_port(avoid=()) -> int:
    import socket

    for p in PORTS:
        if p in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p
    raise RuntimeError("no free port in 8600-8699")


def start_server(work: Path) -> VllmServer:
    port = free_port()
    zport = free_port(avoid=(port,))
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    connector = {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "kvtrace.vllm.fileconnector",
                 "kv_connector_extra_config": {"path": str(work / "kv-blocks")}}
    args = ["--block-size", "32", "--enable-prefix-caching", "--max-num-batched-tokens", "256",
            "--num-gpu-blocks-override", "122", "--max-model-len", "2048", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events), "--kv-transfer-config", json.dumps(connector)]
    # no plugin: the hook gets in by live injection on each attach, and leaves on each detach
    return VllmServer(args=args, port=port, env={"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1"}, workdir=work).start()


def reset_cache(server: VllmServer) -> None:
    req = urllib.request.Request(f"{server.url}/reset_prefix_cache", method="POST", data=b"")
    urllib.request.urlopen(req, timeout=60).read()


def requests(short: bool) -> list[workload.Request]:
    if short:
        return workload.shared_prefix(seed=5, groups=2, per_group=3, prefix_len=512, suffix_len=256, fillers=1,
                                      filler_len=800, max_tokens=48)
    return workload.shared_prefix(seed=5, groups=4, per_group=4, prefix_len=512, suffix_len=384, fillers=2,
                                  filler_len=1000, max_tokens=64)


class Agent:
    """`kvtrace attach --port` with OTLP to a local receiver; RSS and CPU sampled on demand."""

    def __init__(self, server: VllmServer, out: Path, otlp_url: str | None):
        cmd = [PY, "-m", "kvtrace", "attach", "--quiet", "--port", str(server.port), "--out", str(out)]
        if otlp_url:
            cmd += ["--otlp", otlp_url]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines = []
        for line in self.proc.stderr:
            self.lines.append(line)
            if "vLLM hook" in line and "engine" in line:
                break
        else:
            raise RuntimeError("kvtrace attach exited: " + "".join(self.lines))
        self.ps = psutil.Process(self.proc.pid)
        self.rss: list[int] = []
        self._stop = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def sample(self) -> None:
        def run():
            while not self._stop.is_set():
                try:
                    self.rss.append(self.ps.memory_info().rss)
                except psutil.Error:
                    return
                self._stop.wait(0.2)

        self._stop.clear()
        threading.Thread(target=run, daemon=True).start()

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self._stop.set()
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(300)


def one_round(server: VllmServer, reqs, concurrency: int) -> dict:
    reset_cache(server)
    t0 = time.monotonic()
    results = workload.run(server.url, server.model, reqs, concurrency=concurrency)
    wall = time.monotonic() - t0
    errors = [r.error for r in results if r.error]
    tokens = sum(r.completion_tokens for r in results)
    ttft = sorted(r.ttft_s for r in results if r.t_first_ns)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttft),
            "errors": len(errors), "cached_tokens": sum(r.cached_tokens for r in results)}


def spread(xs: list[float]) -> dict:
    return {"mean": round(statistics.fmean(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "stdev": round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0}


def vllm_ab(short: bool) -> dict:
    pairs = 1 if short else 5
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
                r = one_round(server, reqs, concurrency)
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
                print(f"overhead: round {len(rounds)} {mode}: {r['tokens_per_s']:.1f} tokens/s, TTFT p50 "
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
        "requests": len(reqs), "concurrency": concurrency, "pairs": pairs, "rounds": rounds,
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
