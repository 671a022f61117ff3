"""kvtrace's cost to a real vLLM server, and the agent's own CPU and memory (needs root).

A real vLLM CPU server (tiny random-weight Llama, chunked prefill at 256 tokens, prefix
caching, 122 KV blocks, KV events, kvtrace's file KV connector, so KV blocks are stored to
and loaded back from files) serves a fixed shared-prefix workload at concurrency 4, in phases
interleaved A/B/A/B in one session, each phase 3 rounds back to back (1 in --short): A
untraced, B under one `kvtrace attach --port` (every probe this kernel has, the hook injected
live, KV events and /metrics recorded, Parquet written and OTLP streamed to a local
receiver).  The prefix cache is reset before every round.  Reported: tokens/s and TTFT p50
per phase, the server's own CPU time per token (user and system, all its processes), and the
ratio of each B phase to the mean of the A phases either side of it (A B A ... B A), with
their spread; during B phases the agent's CPU (per wall second) and RSS (psutil, sampled
every 0.2 s, after attach: the steady state).  Then the same again with the server on a core
of its own and the agent and the client on the others (``vllm_pinned``: a GPU server's
layout, where the engine's CPU threads do not share cores with the agent).  After the A/B
phases of each layout, one more B phase outside the ratios, with the kernel's BPF run-time
accounting on: the CPU kvtrace's BPF programs took, the steps the hook recorded times its
cost per step, the server's system calls times what the system-call slow path adds to
each, and the agent's /metrics scrapes times what one costs the API server, each as a share
of the server's CPU.  The hook's cost per engine step, detached
and attached, comes from bench/hookstep.py in vLLM's interpreter under `kvtrace attach`.

    sudo .venv/bin/python bench/overhead.py [--short] [--accounted-only] [--model tiny|small] [--json out.json]

--model small: the same with a random-weight Llama of 8 layers of width 1024 instead of the
tests' 2 of 256.  kvtrace's costs are paid per step, per system call and per scrape, not per
FLOP, so their share of the server's CPU falls as a step costs more.

Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from vllmbench import CONCURRENCY, PY, ROOT, Agent, free_port, kvtrace_importable_env, one_round, requests, spread  # noqa: E402

from kvtrace.demo.server import MODELS, VllmServer, demo_args, vllm_python  # noqa: E402

SETTLE_S = 3.0


def start_server(work: Path, cores: set[int] | None = None, model: str = "tiny") -> VllmServer:
    """The demo's server (with ``model``, a key of kvtrace.demo.server.MODELS); with ``cores``,
    all its processes and its OpenMP threads on those cores only (this process's own affinity
    is restored once they have started)."""
    port = free_port()
    zport = free_port(avoid=(port,))
    args = demo_args(work, zport)   # the demo's server
    # no plugin: the hook gets in by live injection on each attach, and leaves on each detach
    env = {"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1", **kvtrace_importable_env()}  # the file connector
    if not cores:
        return VllmServer(args=args, port=port, env=env, workdir=work, model_name=model).start()
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cores)))
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)          # inherited by the server's processes
    try:
        server = VllmServer(args=args, port=port, env=env, workdir=work, model_name=model)
        server.start()
    finally:
        os.sched_setaffinity(0, mine - cores or mine)
    return server


def server_cpu(server: VllmServer) -> dict[str, tuple[float, float]]:
    """User and system CPU seconds of the server's processes, per group (api: the API server,
    which answers /metrics; engine: EngineCore, where the hook runs; workers: the model)."""
    out = {}
    for group, pids in server.processes().items():
        user = system = 0.0
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            user, system = user + t.user, system + t.system
        out[group] = (user, system)
    return out


def split_cores() -> tuple[set[int], set[int]] | None:
    """(the server's cores, everything else's): the last core for the server, the rest for the
    agent and the client; None with fewer than 2 cores."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[-1]}, set(cpus[:-1])) if len(cpus) >= 2 else None


def phase(server: VllmServer, reqs, concurrency: int, n: int) -> dict:
    """n rounds back to back (the agent, in B, attached across all of them): their totals."""
    rs = [one_round(server, reqs, concurrency) for _ in range(n)]
    wall = sum(r["wall_s"] for r in rs)
    return {"wall_s": round(wall, 3), "tokens": sum(r["tokens"] for r in rs),
            "tokens_per_s": sum(r["tokens"] for r in rs) / wall,
            "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in rs), "errors": sum(r["errors"] for r in rs),
            "cached_tokens": sum(r["cached_tokens"] for r in rs), "rounds": n}


STATS = "/proc/sys/kernel/bpf_stats_enabled"


def bpf_programs() -> dict[int, tuple[str, int, int]]:
    """{program id: (name, run time ns, runs)} from bpftool (run time counted while STATS is 1)."""
    out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True, timeout=60)
    return {p["id"]: (p.get("name", "?"), p.get("run_time_ns", 0), p.get("run_cnt", 0))
            for p in json.loads(out.stdout or "[]")}


def syscall_ns(cores: set[int] | None, n: int = 20_000, reps: int = 25) -> float:
    """The fastest of reps loops of n getppid() calls, ns per call, on the server's cores while
    it is idle (a system call kvtrace does not trace: what it costs more while the agent is
    attached is the system-call slow path).  Short loops, so that some run uninterrupted."""
    mine = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        call, best = os.getppid, float("inf")
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                call()
            best = min(best, (time.perf_counter_ns() - t0) / n)
        return best
    finally:
        os.sched_setaffinity(0, mine)


# A program on the tracepoint of a system call nothing here makes: attached, it puts every
# system call of every process on the kernel's slower path, and does nothing else.
NEVER_FIRES = "TRACEPOINT_PROBE(syscalls, sys_enter_acct) { return 0; }"


def slow_path_ns(cores: set[int] | None, pairs: int = 10) -> dict:
    """What the system-call slow path adds to a call, alone: getppid() loops (syscall_ns)
    without and with NEVER_FIRES attached, alternately, pairs times.  The kernel takes the
    same path for a call whose tracepoint has no program whichever syscall tracepoints have
    one, so this is the agent's per-call charge without its other effects on the machine
    (the agent's own threads and interrupts) that a with/without-the-agent comparison adds
    to it.  Run with no other syscall program loaded (the agent stopped)."""
    from bcc import BPF

    tp, fn = "syscalls:sys_enter_acct", "tracepoint__syscalls__sys_enter_acct"
    b = BPF(text=NEVER_FIRES)
    try:
        b.detach_tracepoint(tp)
        diffs = []
        for _ in range(pairs):
            bare = syscall_ns(cores, reps=10)
            b.attach_tracepoint(tp=tp, fn_name=fn)
            try:
                slow = syscall_ns(cores, reps=10)
            finally:
                b.detach_tracepoint(tp)
            diffs.append(slow - bare)
    finally:
        b.cleanup()
    return {"median_ns": round(max(statistics.median(diffs), 0.0), 1), "pairs_ns": [round(d, 1) for d in diffs]}


COUNT_SYSCALLS = """
struct key_t { u32 tgid; u32 nr; };
BPF_HASH(calls, struct key_t, u64, 16384);
RAW_TRACEPOINT_PROBE(sys_enter) {
    struct key_t k = {.tgid = bpf_get_current_pid_tgid() >> 32, .nr = (u32)ctx->args[1]};
    calls.increment(k);
    return 0;
}
"""
# The system calls whose tracepoints kvtrace's programs run on, by number (x86_64 only; on
# other machines every program's runs are charged to the server).
SYSCALL_NR = {"read": 0, "write": 1, "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20,
              "preadv": 295, "pwritev": 296, "preadv2": 327, "pwritev2": 328} if platform.machine() == "x86_64" else {}


def scrape_cost_ms(server: VllmServer, n: int = 20) -> float:
    """The API server's CPU per GET /metrics (ms), over n scrapes while it is idle: what each of
    the agent's scrapes costs the server."""
    def api() -> float:
        return sum(server_cpu(server).get("api", (0.0, 0.0)))

    c0 = api()
    for _ in range(n):
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
            r.read()
    return (api() - c0) * 1000 / n


def scrapes_between(ds, t0: int, t1: int) -> int:
    """The agent's /metrics scrapes in [t0, t1] (CLOCK_MONOTONIC ns): distinct ts_ns of server_metrics
    (vllm_metrics in a dataset of version 1)."""
    table = next((t for t in ("server_metrics", "vllm_metrics") if t in ds.names()), None)
    if table is None:
        return 0
    ts = set(ds.table(table).column("ts_ns").to_pylist())
    return sum(1 for t in ts if t0 <= t <= t1)


def scrape_interval_s(ds) -> float | None:
    """The agent's /metrics interval, from its run row."""
    (run,) = ds.runs()
    for sc in json.loads(run.get("sidecars") or "[]"):
        if sc.get("name") in ("server_metrics", "vllm_metrics"):
            return sc.get("interval_s")
    return None


def metrics_pct(acc: dict) -> float:
    """The scrapes' share of the server's CPU at their steady rate (one per interval: a phase
    shorter than a few intervals holds 0, 1 or 2 of them by chance)."""
    per_s = acc["scrape_cpu_ms"] / 1e3 / acc["scrape_interval_s"] if acc.get("scrape_interval_s") else 0.0
    return round(100 * per_s * acc["wall_s"] / acc["server_cpu_s"], 3)


def server_syscalls():
    """A counter of every process's system calls by number (bcc), read with syscalls_of()."""
    from bcc import BPF

    return BPF(text=COUNT_SYSCALLS)


@functools.lru_cache(maxsize=4)
def syscall_names(header: str = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h") -> dict[int, str]:
    """{number: name} of this machine's system calls, from the C library's header ({} without it)."""
    try:
        text = open(header).read()
    except OSError:
        return {}
    return {int(n): name for name, n in re.findall(r"#define __NR_(\w+) (\d+)", text)}


def syscalls_of(counter, pids: set[int]) -> dict[int, int]:
    """{system call number: calls} of the processes pids."""
    out: dict[int, int] = {}
    for k, v in counter["calls"].items():
        if k.tgid in pids:
            out[k.nr] = out.get(k.nr, 0) + v.value
    return out


def tracepoints() -> dict[int, str]:
    """{program id: the tracepoint it runs on} (bpftool perf; bcc attaches tracepoints through
    perf events, and the kernel shortens program names to 15 characters)."""
    out = subprocess.run(["bpftool", "perf", "show", "--json"], capture_output=True, text=True, timeout=60)
    return {p["prog_id"]: p.get("tracepoint", "") for p in json.loads(out.stdout or "[]") if "prog_id" in p}


def server_bpf_ns(runs: dict[int, tuple[int, int]], where: dict[int, str], calls: dict[int, int]) -> float:
    """The part of kvtrace's BPF run time spent on the server's own events.  ``runs``: {program
    id: (run time ns, runs)}; ``where``: {program id: tracepoint}; ``calls``: the server's
    system calls by number.  A program on a system call's tracepoint runs once per call of
    every process (the load generator's and the agent's too): the server is charged its calls'
    share of the runs at the program's mean run time.  Every other program (block, io_uring,
    scheduler, TCP) is charged in full."""
    total = 0.0
    for prog, (ns, n) in runs.items():
        m = re.fullmatch(r"sys_(?:enter|exit)_(\w+)", where.get(prog, ""))
        nr = SYSCALL_NR.get(m.group(1)) if m else None
        total += ns if nr is None or n <= 0 else ns * min(calls.get(nr, 0), n) / n
    return total


def accounted_phase(server: VllmServer, reqs, concurrency: int, n: int, work: Path, otlp_url: str | None,
                    cores: set[int] | None = None) -> dict:
    """One more B phase, not in the ratios (the kernel's run-time accounting costs a little):
    the CPU time kvtrace's BPF programs took, from the kernel's own per-program counters, and
    the engine steps the hook recorded (times its cost per step: the hook's share).  And the
    system-call slow path: once any syscall tracepoint has a program, every system call of
    every process takes the kernel's slower entry and exit.  Its cost per call is measured on
    an untraced system call with and without a program that never runs (slow_path_ns, after
    the agent stopped; with and without the agent itself is reported beside it), and charged
    to the server for every system call it made in the phase (counted by a program of this
    bench, loaded after the agent's and not counted among them).  And the agent's /metrics
    scrapes, one per its interval, each charged what one costs the API server's CPU while idle."""
    bare = [syscall_ns(cores)]
    scrape_ms = scrape_cost_ms(server)
    before = set(bpf_programs())
    agent = Agent(server, work / "accounted", otlp_url)
    time.sleep(SETTLE_S)
    mine = set(bpf_programs()) - before   # the agent's programs
    traced = [syscall_ns(cores)]
    counter = server_syscalls()
    pids = {p for ps in server.processes().values() for p in ps}
    old = open(STATS).read().strip()
    with open(STATS, "w") as f:
        f.write("1")
    try:
        p0, c0, s0, t0 = bpf_programs(), server_cpu(server), syscalls_of(counter, pids), time.monotonic_ns()
        r = phase(server, reqs, concurrency, n)
        p1, c1, s1, t1 = bpf_programs(), server_cpu(server), syscalls_of(counter, pids), time.monotonic_ns()
        where = tracepoints()
    finally:
        with open(STATS, "w") as f:
            f.write(old)
        counter.cleanup()
        time.sleep(1)          # the server idle again
        traced.append(syscall_ns(cores))
        agent.stop()
    bare.append(syscall_ns(cores))
    isolated = slow_path_ns(cores)
    progs = sorted(((p1[i][1] - p0[i][1], p1[i][2] - p0[i][2], p1[i][0]) for i in p1 if i in p0 and i in mine), reverse=True)
    from kvtrace.dataset.reader import Dataset

    ds = Dataset.open(work / "accounted")
    steps = ds.table("step").num_rows
    frames = hook_frames(ds)
    scrapes = scrapes_between(ds, t0, t1)
    server_s = sum(sum(c1[g]) - sum(c0[g]) for g in c0 if g in c1)
    bpf_ns = sum(t for t, _, _ in progs)
    by_nr = {nr: s1[nr] - s0.get(nr, 0) for nr in s1}
    own_ns = server_bpf_ns({i: (p1[i][1] - p0[i][1], p1[i][2] - p0[i][2]) for i in p1 if i in p0 and i in mine},
                           where, by_nr)
    slow_ns = isolated["median_ns"]
    calls = sum(by_nr.values())
    acc = {"wall_s": r["wall_s"], "tokens": r["tokens"], "server_cpu_s": round(server_s, 3), "steps_recorded": steps,
           "hook_frames": frames,
           "bpf_cpu_ms": round(bpf_ns / 1e6, 2), "bpf_all_pct_of_server_cpu": round(100 * bpf_ns / 1e9 / server_s, 3),
           "bpf_server_cpu_ms": round(own_ns / 1e6, 2), "bpf_pct_of_server_cpu": round(100 * own_ns / 1e9 / server_s, 3),
           "server_syscalls_per_s": round(calls / r["wall_s"]), "syscall_ns": {"without": [round(x, 1) for x in bare],
                                                                            "with": [round(x, 1) for x in traced]},
           "server_syscalls_top": top_syscalls(by_nr, r["wall_s"]),
           # charged: the slow path alone; beside it, getppid with the agent attached against without
           "slow_path_ns": round(slow_ns, 1), "slow_path_pairs_ns": isolated["pairs_ns"],
           "slow_path_with_agent_ns": round(max(min(traced) - min(bare), 0.0), 1), "slow_path_pct_of_server_cpu": round(100 * calls * slow_ns / 1e9 / server_s, 3),
           # of which sched_yield: OpenMP threads spinning at a barrier; a slower call there
           # delays only the thread the yield hands the CPU to, so this part is an upper bound
           "slow_path_sched_yield_pct_of_server_cpu": round(100 * yields(by_nr) * slow_ns / 1e9 / server_s, 3),
           "metrics_scrapes": scrapes, "scrape_cpu_ms": round(scrape_ms, 2), "scrape_interval_s": scrape_interval_s(ds),
           "bpf_top": [{"program": n, "ms": round(t / 1e6, 2), "runs": c, "ns_per_run": round(t / max(c, 1))}
                       for t, c, n in progs[:6]]}
    acc["metrics_pct_of_server_cpu"] = metrics_pct(acc)
    return acc


def yields(by_nr: dict[int, int]) -> int:
    """The sched_yield calls among the server's system calls."""
    return sum(c for nr, c in by_nr.items() if syscall_names().get(nr) == "sched_yield")


def top_syscalls(by_nr: dict[int, int], wall_s: float, n: int = 8) -> dict[str, int]:
    """The server's most frequent system calls, calls per second by name."""
    names = syscall_names()
    top = sorted(by_nr.items(), key=lambda kv: -kv[1])[:n]
    return {names.get(nr, str(nr)): round(c / wall_s) for nr, c in top if c}


def hook_frames(ds) -> int:
    """The hook's marker writes in a capture: every record of a write has that write's
    (pid, mark_ns)."""
    import pyarrow as pa

    keys = []
    for name in ds.names():
        t = ds.table(name)
        if "mark_ns" in t.column_names and "pid" in t.column_names:
            keys.append(t.select(["pid", "mark_ns"]))
    if not keys:
        return 0
    t = pa.concat_tables(keys)
    return t.group_by(["pid", "mark_ns"]).aggregate([]).num_rows


def vllm_ab(short: bool, pin: bool = False, accounted_only: bool = False, model: str = "tiny") -> dict:
    """Interleaved A/B phases.  With ``pin``, the server runs on a core of its own and the
    agent and the client on the others: a GPU server's layout, where the engine's CPU threads
    are not shared with the agent."""
    pairs = 1 if short else 5
    per_phase = 1 if short else 3   # rounds per A or B phase: the steady state outweighs the attach
    concurrency = CONCURRENCY
    reqs = requests(short)
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-overhead-"))
    receiver = None
    try:
        from tests.otlp_receiver import Receiver

        receiver = Receiver().start()
    except Exception as e:  # OTLP export is then left out of B, and said
        print(f"overhead: no local OTLP receiver ({type(e).__name__}: {e}); B runs without --otlp", file=sys.stderr)
    cores = split_cores() if pin else None
    if pin and cores is None:
        return {"skipped": "fewer than 2 cores: no core to give the server alone"}
    server = start_server(work, cores[0] if cores else None, model)
    rounds = []
    agent_cpu, agent_rss = [], []
    try:
        one_round(server, reqs, concurrency)                  # warm-up: compile, storage filled
        # A B A B ... A: each B is compared with the A phases either side of it, so a drift of
        # the server's speed over the session does not count as the agent's cost
        for k, mode in enumerate([] if accounted_only else ["A", "B"] * pairs + ["A"]):
            i = k // 2
            agent = None
            if mode == "B":
                agent = Agent(server, work / f"ds{i}", receiver.grpc_url if receiver else None)
                time.sleep(SETTLE_S)          # past the first flushes: the steady state is measured
                agent.sample()
                c0 = agent.cpu()
            cpu0 = server_cpu(server)
            r = phase(server, reqs, concurrency, per_phase)
            cpu1 = server_cpu(server)
            per_token = lambda secs: round(secs * 1000 / max(r["tokens"], 1), 4)  # noqa: E731
            r["server_cpu_ms_per_token"] = {
                "user": per_token(sum(cpu1[g][0] - cpu0[g][0] for g in cpu0 if g in cpu1)),
                "system": per_token(sum(cpu1[g][1] - cpu0[g][1] for g in cpu0 if g in cpu1)),
                **{g: per_token(sum(cpu1[g]) - sum(cpu0[g])) for g in cpu0 if g in cpu1}}
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
        accounted = accounted_phase(server, reqs, concurrency, per_phase, work, receiver.grpc_url if receiver else None,
                                    cores[0] if cores else None)
    finally:
        server.stop()
        if receiver is not None:
            receiver.stop()
        if cores:
            os.sched_setaffinity(0, cores[0] | cores[1])
    if accounted_only:
        return {"accounted": accounted, "load_average": round(os.getloadavg()[0], 2), "model": model,
                "server_cores": sorted(cores[0]) if cores else None}
    a = [r for r in rounds if r["mode"] == "A"]
    b = [r for r in rounds if r["mode"] == "B"]
    def against_neighbours(f) -> list[float]:
        return [f(y) / statistics.fmean((f(a[i]), f(a[i + 1]))) for i, y in enumerate(b) if i + 1 < len(a)]

    tps = against_neighbours(lambda r: r["tokens_per_s"])
    ttft = against_neighbours(lambda r: r["ttft_p50_s"])
    cpu_user = against_neighbours(lambda r: r["server_cpu_ms_per_token"]["user"])
    cpu_sys = against_neighbours(lambda r: r["server_cpu_ms_per_token"]["system"])
    mean_a = statistics.fmean(r["tokens_per_s"] for r in a)
    mean_b = statistics.fmean(r["tokens_per_s"] for r in b)
    for r in rounds:
        r["tokens_per_s"] = round(r["tokens_per_s"], 2)
        r["ttft_p50_s"] = round(r["ttft_p50_s"], 4)
    return {
        "model": model, "requests": len(reqs), "concurrency": concurrency, "pairs": pairs, "rounds_per_phase": per_phase, "rounds": rounds,
        "otlp": receiver is not None,
        "tokens_per_s": {"A": round(mean_a, 2), "B": round(mean_b, 2)},
        "tokens_per_s_ratio": spread(tps), "ttft_p50_ratio": spread(ttft),
        "server_cpu_per_token_ratio": {"user": spread(cpu_user), "system": spread(cpu_sys),
                                       **{g: spread(against_neighbours(lambda r, g=g: r["server_cpu_ms_per_token"][g]))
                                          for g in ("api", "engine", "workers")}},
        "throughput_loss_pct": round((1 - statistics.fmean(tps)) * 100, 2),
        "errors": sum(r["errors"] for r in rounds),
        "agent_cpu_pct_of_core": spread([c * 100 for c in agent_cpu]),
        "agent_rss_mib": {"mean": round(statistics.fmean(agent_rss) / 2**20, 1), "max": round(max(agent_rss) / 2**20, 1)}
        if agent_rss else None,
        "accounted": accounted,
        "load_average": round(os.getloadavg()[0], 2),
        "server_cores": sorted(cores[0]) if cores else None,
        "agent_cores": sorted(cores[1]) if cores else None,
    }


def hook_cost(short: bool, layers: int = 2) -> dict:
    """bench/hookstep.py in vLLM's interpreter, under kvtrace attach (so 'attached' is real),
    with the model's count of layers (a wait_for_layer_load call each per Worker step)."""
    with tempfile.TemporaryDirectory() as d:
        res = os.path.join(d, "hook.json")
        rounds = "3" if short else "15"
        p = subprocess.run([PY, "-m", "kvtrace", "attach", "--quiet", "--out", os.path.join(d, "ds"), "--",
                            vllm_python(), str(ROOT / "bench" / "hookstep.py"), "--rounds", rounds, "--json", res,
                            "--layers", str(layers)]
                           + (["--short"] if short else []),
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
    ap.add_argument("--accounted-only", action="store_true",
                    help="no A/B phases: the hook's cost and one accounted phase per layout")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="the server's random-weight Llama: tiny (2 layers of 256, the tests' model) or small "
                         "(8 layers of 1024: 3-4 times the CPU a step)")
    a = ap.parse_args()
    if not os.path.exists(vllm_python()):
        result = {"skipped": f"no vLLM interpreter at {vllm_python()} (scripts/setup-vllm, or set KVTRACE_VLLM_PYTHON)"}
    else:
        result = {"model": a.model, "hook": hook_cost(a.short, MODELS[a.model]["num_hidden_layers"])}
        if not a.skip_vllm:
            result["vllm"] = vllm_ab(a.short, accounted_only=a.accounted_only, model=a.model)
            result["vllm_pinned"] = vllm_ab(a.short, pin=True, accounted_only=a.accounted_only, model=a.model)
            per_step = result["hook"]["hook_cost_us"].get("attached")
            # one marker write: the larger of its two estimates (median and fastest rounds)
            per_write = max(result["hook"].get("write_cost_us", 0.0), result["hook"].get("write_cost_fastest_us", 0.0), 0.0)
            for v in (result["vllm"], result["vllm_pinned"]):
                acc = v.get("accounted")
                if acc and per_step is not None:
                    # the hook's cost per step times the steps it recorded, plus its writes
                    hook_s = (acc["steps_recorded"] * per_step + acc["hook_frames"] * per_write) / 1e6
                    acc["hook_pct_of_server_cpu"] = round(100 * hook_s / acc["server_cpu_s"], 3)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
