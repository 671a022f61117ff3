"""Live attach to a running vLLM server, measured (needs root).

Two real vLLM CPU servers (tiny random-weight Llama, chunked prefill at 256 tokens, prefix
caching, 122 KV blocks) run side by side: one started without the plugin (VLLM_PLUGINS="",
so the hook gets in only by live injection) and one with kvtrace's plugin entry point
(VLLM_PLUGINS=kvtrace: the hook is installed at start-up).  Measured:

1. **Attach to first chunk.**  While a steady stream of streaming requests runs (fresh random
   prompts, each prefilled in chunks), `kvtrace attach --port` is launched against the server
   without the plugin.  The time from launch (CLOCK_MONOTONIC) to the first `chunk` record the
   hook wrote (its `mark_ns`, same clock), split by the agent's own phase marks
   (KVTRACE_TIMINGS=1, kvtrace/phases.py): interpreter start, discovery, BPF build and load,
   the rest of the set-up, injection into EngineCore and Worker, first `step` record.
2. **Pause during injection.**  Client side (the independent source: the hook is not there
   before injection): the gaps between successive streamed token messages of the requests
   running across the injection; the longest gap overlapping the injection against the median
   gap before the launch.  Hook side: the engine's step gaps after its injection (the Worker is
   injected after the engine, so the hook sees that pause); the same for the removal at detach.
3. **Injected against plugin hook.**  The shared-prefix round of bench/overhead.py, interleaved
   in one session (I P P I ...): I = `kvtrace attach --port` on the server without the plugin
   (hook injected, removed at the end of the round), P = `kvtrace attach --port --no-inject` on
   the plugin server (its hook records as soon as an agent is attached).  Tokens/s per round,
   I/P ratio of adjacent rounds with its spread, and the hook records per round.

    sudo .venv/bin/python bench/attach.py [--short] [--json out.json]

Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from vllmbench import CONCURRENCY, Agent, free_port, kvtrace_importable_env, one_round, requests, spread  # noqa: E402

from kvtrace import phases  # noqa: E402
from kvtrace.hook.vllm.hook import HOOK_VERSION  # noqa: E402
from kvtrace.demo import workload  # noqa: E402
from kvtrace.demo.server import VllmServer, vllm_python  # noqa: E402

SERVER_ARGS = ["--block-size", "32", "--enable-prefix-caching", "--max-num-batched-tokens", "256",
               "--num-gpu-blocks-override", "122", "--max-model-len", "2048", "--enable-prompt-tokens-details"]
SETTLE_S = 3.0
START_TIMEOUT_S = 300.0   # an agent not attached and injected by then is killed, and the failure reported
STOP_TIMEOUT_S = 180.0    # likewise for the removal at detach
PLUGIN_LOG = f"kvtrace hook {HOOK_VERSION} installed (engine"


def start_servers(work: Path) -> tuple[VllmServer, VllmServer]:
    """(without plugin, with plugin), started at the same time; the same flags otherwise."""
    port_i = free_port()
    port_p = free_port(avoid=(port_i,))
    base = {"VLLM_SERVER_DEV_MODE": "1", **kvtrace_importable_env()}
    inj = VllmServer(args=SERVER_ARGS, port=port_i, env={**base, "VLLM_PLUGINS": ""}, workdir=work / "injected")
    plg = VllmServer(args=SERVER_ARGS, port=port_p, env={**base, "VLLM_PLUGINS": "kvtrace"}, workdir=work / "plugin")
    errors = []

    def start(s):
        try:
            s.start(timeout=600)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in (inj, plg)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        inj.stop()
        plg.stop()
        raise errors[0]
    if PLUGIN_LOG not in plg.log_path.read_text(errors="replace"):
        inj.stop()
        plg.stop()
        raise RuntimeError(f"the kvtrace plugin did not install in the plugin server; see {plg.log_path}")
    return inj, plg


class Stream:
    """``loops`` clients sending streaming requests back to back, each a fresh random prompt
    (so every request is prefilled in chunks), until stopped; every token message timed."""

    def __init__(self, server: VllmServer, loops: int = 2, prompt_len: int = 600, max_tokens: int = 48, seed: int = 11):
        self.server, self.loops, self.prompt_len, self.max_tokens = server, loops, prompt_len, max_tokens
        self.rng = random.Random(seed)
        self.results: list[workload.Result] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._n = 0
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(loops)]

    def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._n += 1
                req = workload.Request(f"stream{i}-{self._n}", workload.tokens(self.rng, self.prompt_len), self.max_tokens)
            res = workload.send(self.server.url, self.server.model, req)
            with self._lock:
                self.results.append(res)
            if res.error:
                time.sleep(0.1)

    def __enter__(self) -> "Stream":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def ms(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 1)


def gaps(results: list[workload.Result]) -> list[tuple[int, int]]:
    """(a, b) between successive token messages of each request."""
    out = []
    for r in results:
        out += list(zip(r.t_tokens_ns, r.t_tokens_ns[1:]))
    return out


def window_gap(gs: list[tuple[int, int]], start: int, end: int) -> int | None:
    """The longest gap overlapping [start, end]."""
    over = [b - a for a, b in gs if a < end and b > start]
    return max(over) if over else None


def phase_times(lines: list[str]) -> dict:
    """First time of each phase mark; per-pid injection windows by action."""
    first: dict[str, int] = {}
    inject: dict[str, dict[int, list[int]]] = {"install": {}, "uninstall": {}}
    for name, detail, t in phases.parse(lines):
        if name in ("inject_start", "inject_end"):
            action, pid = detail[0], int(detail[1])
            w = inject[action].setdefault(pid, [0, 0])
            if name == "inject_start" and not w[0]:
                w[0] = t
            elif name == "inject_end":
                w[1] = t
        else:
            first.setdefault(name, t)
    return {"first": first, "inject": inject}


def hook_records(out: Path) -> dict:
    from kvtrace.dataset.reader import Dataset

    ds = Dataset.open(out)
    names = ds.names()
    rec = {}
    for name in ("step", "chunk"):
        rec[name] = ds.table(name).to_pylist() if name in names else []
    return rec


def attach_trial(server: VllmServer, work: Path, k: int, short: bool) -> dict:
    baseline_s = 4.0 if short else 8.0
    after_s = 4.0 if short else 6.0
    procs = server.processes()
    engine, workers = procs["engine"][0], procs["workers"]
    out = work / f"trial{k}"
    with Stream(server) as stream:
        try:
            time.sleep(baseline_s)
            agent = Agent(server, out, env={"KVTRACE_TIMINGS": "1"}, start_timeout=START_TIMEOUT_S,
                          ready=lambda line: "vLLM hook" in line and "worker" in line or "signals missing" in line)
            t_launch = agent.t_launch_ns
            time.sleep(after_s)
            if not agent.stop(STOP_TIMEOUT_S):
                raise RuntimeError(f"kvtrace attach did not exit within {STOP_TIMEOUT_S:g} s of SIGINT (killed): "
                                   + "".join(agent.lines)[-1500:])
        except RuntimeError:
            server.stop()    # it may be stuck: the stream's requests end now
            raise
        time.sleep(1.5)      # the stream goes on across the removal
    if agent.proc.returncode != 0:
        raise RuntimeError(f"kvtrace attach exited {agent.proc.returncode}: {''.join(agent.lines)[-2000:]}")
    ph = phase_times(agent.lines)
    f, inst, rem = ph["first"], ph["inject"]["install"], ph["inject"]["uninstall"]
    if engine not in inst or not all(w in inst for w in workers):
        raise RuntimeError("no injection into the engine and workers: " + "".join(agent.lines)[-2000:])
    rec = hook_records(out)
    steps = sorted((r for r in rec["step"] if r["pid"] == engine), key=lambda r: r["t_start_ns"])
    chunks = [r for r in rec["chunk"] if r["pid"] == engine]
    if not steps or not chunks:
        raise RuntimeError(f"the hook recorded {len(steps)} steps and {len(chunks)} chunks")
    first_chunk = min(chunks, key=lambda r: r["mark_ns"])
    sched = {r["step"]: r for r in steps}
    inj_start = min(w[0] for w in inst.values())
    inj_end = max(w[1] for w in inst.values())

    # client side
    gs = gaps(stream.results)
    base = sorted(b - a for a, b in gs if b < t_launch)
    base_med = statistics.median(base) if base else None

    def pause(start, end):
        g = window_gap(gs, start, end)
        return {"window_ms": ms(end - start), "max_gap_ms": ms(g),
                "max_gap_over_median": round(g / base_med, 1) if g and base_med else None}

    client = {
        "requests": len(stream.results), "errors": sum(1 for r in stream.results if r.error),
        "baseline_gaps": len(base), "baseline_median_gap_ms": ms(base_med),
        "baseline_p99_gap_ms": ms(base[int(0.99 * (len(base) - 1))]) if base else None,
        "baseline_max_gap_ms": ms(base[-1]) if base else None,
        "injection": pause(inj_start, inj_end),
        "injection_engine": pause(*inst[engine]),
        "injection_workers": pause(min(inst[w][0] for w in workers), max(inst[w][1] for w in workers)),
        "bpf_build": pause(f["bpf_start"], f["bpf_loaded"]) if "bpf_loaded" in f else None,
        "removal": pause(min(w[0] for w in rem.values()), max(w[1] for w in rem.values())) if rem else None,
    }
    # hook side: step starts after the engine's injection
    starts = [r["t_start_ns"] for r in steps]
    sg = list(zip(starts, starts[1:]))
    med = statistics.median(b - a for a, b in sg) if sg else None
    wstart, wend = min(inst[w][0] for w in workers), max(inst[w][1] for w in workers)
    wg = window_gap(sg, wstart, wend)
    hook = {"steps": len(steps), "chunks": len(chunks), "median_step_gap_ms": ms(med),
            "max_step_gap_ms": ms(max((b - a for a, b in sg), default=None)),
            "worker_injection_max_step_gap_ms": ms(wg),
            "worker_injection_max_over_median": round(wg / med, 1) if wg and med else None,
            "first_step_after_engine_injected_ms": ms(steps[0]["t_start_ns"] - inst[engine][1])}

    def at(t):
        return ms(t - t_launch) if t else None

    timeline = {
        "main": at(f.get("main")), "discover_end": at(f.get("discover_end")), "bpf_start": at(f.get("bpf_start")),
        "bpf_loaded": at(f.get("bpf_loaded")), "capture_start": at(f.get("capture_start")),
        "inject_start": at(inj_start), "engine_injected": at(inst[engine][1]), "inject_end": at(inj_end),
        "first_step_recorded": at(min(r["mark_ns"] for r in steps)),
        "first_chunk_scheduled": at(sched[first_chunk["step"]]["t_sched_end_ns"]) if first_chunk["step"] in sched else None,
        "first_chunk_recorded": at(first_chunk["mark_ns"]),
    }
    split = {
        "start_and_imports": at(f["discover_start"]),
        "discovery": ms(f["discover_end"] - f["discover_start"]),
        "bpf_build_and_load": ms(f["bpf_loaded"] - f["bpf_start"]),
        "other_setup": ms((f["bpf_start"] - f["discover_end"]) + (inj_start - f["bpf_loaded"])),
        "injection_engine": ms(inst[engine][1] - inst[engine][0]),
        "injection_workers": ms(sum(inst[w][1] - inst[w][0] for w in workers)),
        "first_step_after_engine_injected": ms(min(r["mark_ns"] for r in steps) - inst[engine][1]),
        "first_chunk_after_injection": ms(first_chunk["mark_ns"] - inj_end),
    }
    r = {"attach_to_first_chunk_ms": timeline["first_chunk_recorded"], "timeline_ms": timeline, "split_ms": split,
         "client": client, "hook": hook, "load_average": round(os.getloadavg()[0], 2)}
    print(f"attach: trial {k}: first chunk {r['attach_to_first_chunk_ms']} ms after launch; injection pause "
          f"{client['injection']['max_gap_ms']} ms vs median gap {client['baseline_median_gap_ms']} ms", file=sys.stderr)
    return r


def restart(server: VllmServer) -> VllmServer:
    """A server an agent left stuck (killed while injecting or removing the hook): a fresh one
    with the same flags and port, so the benchmark goes on."""
    server.stop()
    fresh = VllmServer(args=server.args, port=server.port, env=server.env,
                       workdir=Path(f"{server.workdir}-{time.monotonic_ns()}"))
    return fresh.start(timeout=600)


def throughput(servers: dict[str, VllmServer], work: Path, short: bool, failures: list) -> dict:
    """servers: {"I": without plugin, "P": with plugin}; replaced in place when restarted."""
    pairs = 1 if short else 4
    concurrency = CONCURRENCY
    reqs = requests(short)
    for server in servers.values():
        one_round(server, reqs, concurrency)     # warm-up
    order = []
    for i in range(pairs):
        order += ["I", "P"] if i % 2 == 0 else ["P", "I"]
    rounds = []
    for n, mode in enumerate(order):
        out = work / f"round{n}-{mode}"
        server = servers[mode]
        try:
            if mode == "I":
                agent = Agent(server, out, start_timeout=START_TIMEOUT_S,
                              ready=lambda line: "vLLM hook" in line and "worker" in line or "signals missing" in line)
            else:
                agent = Agent(server, out, extra=["--no-inject"], env={"KVTRACE_TIMINGS": "1"},
                              start_timeout=START_TIMEOUT_S, ready=lambda line: "timing capture_start" in line)
            time.sleep(SETTLE_S)    # past the injection and the first flushes; the plugin hook sees the agent
            r = one_round(server, reqs, concurrency)
            if not agent.stop(STOP_TIMEOUT_S):
                raise RuntimeError(f"kvtrace attach did not exit within {STOP_TIMEOUT_S:g} s of SIGINT (killed): "
                                   + "".join(agent.lines)[-1500:])
        except RuntimeError as e:
            failures.append({"where": f"round {n + 1} ({mode})", "error": str(e)})
            print(f"attach: round {n + 1} {mode} failed: {str(e)[:300]}", file=sys.stderr)
            servers[mode] = restart(server)
            rounds.append({"mode": mode, "failed": True})
            continue
        rec = hook_records(out)
        r.update(mode=mode, agent_exit=agent.proc.returncode, steps_recorded=len(rec["step"]), chunks_recorded=len(rec["chunk"]),
                 tokens_per_s=round(r["tokens_per_s"], 2), ttft_p50_s=round(r["ttft_p50_s"], 4))
        rounds.append(r)
        print(f"attach: round {n + 1} {mode}: {r['tokens_per_s']:.1f} tokens/s, {r['steps_recorded']} steps recorded",
              file=sys.stderr)
    # adjacent I/P pairs, in the order they ran; a pair with a failed round is left out
    ratios = [(a if a["mode"] == "I" else b)["tokens_per_s"] / (b if a["mode"] == "I" else a)["tokens_per_s"]
              for a, b in zip(rounds[::2], rounds[1::2]) if not a.get("failed") and not b.get("failed")]
    mean = {m: [r["tokens_per_s"] for r in rounds if r["mode"] == m and not r.get("failed")] for m in "IP"}
    return {"requests": len(reqs), "concurrency": concurrency, "pairs": pairs, "complete_pairs": len(ratios), "rounds": rounds,
            "tokens_per_s": {"injected": round(statistics.fmean(mean["I"]), 2) if mean["I"] else None,
                             "plugin": round(statistics.fmean(mean["P"]), 2) if mean["P"] else None},
            "injected_over_plugin": spread(ratios) if ratios else None,
            "errors": sum(r.get("errors", 0) for r in rounds), "load_average": round(os.getloadavg()[0], 2)}


def summarise(trials: list[dict]) -> dict | None:
    if not trials:
        return None

    def vals(get):
        xs = [get(t) for t in trials]
        return [x for x in xs if x is not None]

    def s(get):
        xs = vals(get)
        return spread(xs) if xs else None

    return {
        "attach_to_first_chunk_ms": s(lambda t: t["attach_to_first_chunk_ms"]),
        "split_ms": {k: s(lambda t, k=k: t["split_ms"][k]) for k in trials[0]["split_ms"]},
        "injection_max_gap_ms": s(lambda t: t["client"]["injection"]["max_gap_ms"]),
        "injection_max_over_median": s(lambda t: t["client"]["injection"]["max_gap_over_median"]),
        "baseline_median_gap_ms": s(lambda t: t["client"]["baseline_median_gap_ms"]),
        "removal_max_gap_ms": s(lambda t: (t["client"]["removal"] or {}).get("max_gap_ms")),
        "bpf_build_max_gap_ms": s(lambda t: (t["client"]["bpf_build"] or {}).get("max_gap_ms")),
        "hook_median_step_gap_ms": s(lambda t: t["hook"]["median_step_gap_ms"]),
        "hook_worker_injection_max_step_gap_ms": s(lambda t: t["hook"]["worker_injection_max_step_gap_ms"]),
        "load_average": s(lambda t: t.get("load_average")),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true", help="CI mode: one attach trial, one injected/plugin pair, small rounds")
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    if not os.path.exists(vllm_python()):
        result = {"skipped": f"no vLLM interpreter at {vllm_python()} (scripts/setup-vllm, or set KVTRACE_VLLM_PYTHON)"}
    else:
        work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-attach-"))
        servers = dict(zip("IP", start_servers(work)))
        trials, failures = [], []
        n = 1 if a.short else 3
        try:
            for k in range(n):
                try:
                    trials.append(attach_trial(servers["I"], work, k, a.short))
                except RuntimeError as e:
                    failures.append({"where": f"trial {k}", "error": str(e)})
                    print(f"attach: trial {k} failed: {str(e)[:300]}", file=sys.stderr)
                    servers["I"] = restart(servers["I"])
            result = {"trials": trials, "summary": summarise(trials),
                      "throughput": throughput(servers, work, a.short, failures)}
            result["failures"] = failures
            result["attaches_with_injection"] = n + result["throughput"]["pairs"]
        finally:
            for server in servers.values():
                server.stop()
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
