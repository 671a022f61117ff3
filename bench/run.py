"""Run every benchmark and write a results table (bench/results/results.{md,json}).

    sudo .venv/bin/python bench/run.py           # full mode, by hand (also overhead.py --model small)
    sudo .venv/bin/python bench/run.py --short   # make bench-short: short runs, so the benchmarks cannot rot

Benchmarks report ratios and rates measured side by side in one run; nothing here
asserts a speed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["capacity", "correlate", "analysis", "overhead", "attach", "parquet"]
# full mode only: the cost to a server whose steps cost 3-4 times the CPU (bench/overhead.py --model)
FULL_ONLY = {"overhead_small": ("overhead", ["--model", "small"])}


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), kernel {platform.release()}"


def markdown(results: dict) -> str:
    cap = results["capacity"]
    lines = [
        f"# kvtrace benchmarks ({results['date']}, {results['machine']}, {'short' if results['short'] else 'full'} mode)",
        "",
        "## Kernel event capacity (pread of 64 B on tmpfs, one file_io event per call)",
        "",
        f"- untraced producer: {cap['untraced_calls_per_s']:,} calls/s; traced flat out: {cap['traced_calls_per_s']:,} calls/s;"
        f" per-event cost on the traced process: {cap['per_event_cost_us']} µs",
        "",
        f"- agent alone (pre-filled ring, one core): {cap['agent_throughput']['total_per_s']:,} events/s read+decoded+written"
        f" (read {cap['agent_throughput']['read_per_s']:,}/s, decode {cap['agent_throughput']['decode_per_s']:,}/s,"
        f" Parquet {cap['agent_throughput']['write_per_s']:,}/s; {cap['agent_throughput']['events']:,} events, lost {cap['agent_throughput']['lost']})",
        "",
        "| target rate | producer calls/s | decoded events/s | lost (kernel count) | all accounted |",
        "|---|---|---|---|---|",
    ]
    for r in cap["rates"]:
        lines.append(f"| {r['target_rate']} | {r['producer_rate']:,} | {r['decoded_per_s']:,} | {r['lost']:,} | {r['accounted']} |")
    if "block" in cap:
        lines += block_markdown(cap["block"])
    if "auto_series" in cap:
        lines += auto_markdown(cap["auto_series"])
    elif "auto_sampling" in cap:
        au = cap["auto_sampling"]
        lines += ["", f"- `--sampling auto` (the default), flat out on a 64-page ring: {au['producer_calls']:,} calls; "
                  f"in-kernel file_agg {au['agg_calls']:,} (the interpreter's own start-up preads included); raw rows "
                  f"{au['decoded_events']:,} with weights summing to {au['raw_weight']:,} + {au['lost_weight']:,} lost "
                  f"({au['lost']:,} failed reserves); sampled up to 1 in {au['max_n']} for {au['sampled_s']} s"]
    if "correlate" in results:
        lines += correlate_markdown(results["correlate"])
    if "analysis" in results:
        a, w = results["analysis"]["analyze"], results["analysis"]["whatif"]
        lines += ["", "## Offline analysis (bench/analysis.py)", "",
                  f"- `kvtrace analyze` (DuckDB) of {a['events']:,} synthetic events: {a['analyze_s']} s wall, "
                  f"{a['analyze_cpu_s']} s CPU (load average {a['load_avg_1m']:.1f}; target under 5 s)",
                  f"- `whatif` replay: {w['lookups_per_s']:,} block lookups/s wall, {w['lookups_per_cpu_s']:,} per CPU second "
                  "(target 1M/s)"]
    for key in ("overhead", "overhead_small"):
        if key in results:
            lines += overhead_markdown(results[key])
    if "attach" in results:
        lines += attach_markdown(results["attach"])
    if "parquet" in results:
        lines += parquet_markdown(results["parquet"])
    return "\n".join(lines) + "\n"


def overhead_markdown(o: dict) -> list[str]:
    model = o.get("model", "tiny")
    out = ["", f"## Cost to a real vLLM server (bench/overhead.py, the {model} model)", ""]
    if "skipped" in o:
        return out + [f"- skipped: {o['skipped']}"]
    h = o["hook"]
    for key, layout in (("vllm", "the server on every core, shared with the agent and the client"),
                        ("vllm_pinned", "the server on a core of its own, the agent and the client on the others")):
        if key in o:
            out += ab_markdown(o[key], layout)
    q = h["hook_cost_quartiles_us"]
    out += [
        f"- hook cost per engine step (a real vLLM Scheduler driven through the same round, "
        f"{h['steps_per_stream']['none']} steps per stream, {h.get('layers', 2)} layer waits a Worker step, "
        f"{h['rounds']} rounds, median of per-round differences; step without hook {h['median_step_us']['none']} µs): "
        + "; ".join(f"{m} {c} µs (quartiles {q[m][0]}..{q[m][2]})" for m, c in h["hook_cost_us"].items())
        + (f"; one marker write {h['write_cost_us']} µs (one send per step against one per interval)"
           if "write_cost_us" in h else "")
        + f"; {h['steps_recorded']:,} step records captured while attached",
    ]
    return out


def block_markdown(b: dict) -> list[str]:
    out = ["", f"## Kernel event capacity through the block layer (O_DIRECT preadv of 4 KiB across {b['device']}: one "
           "file_io and one block_io event per call)", "",
           f"- untraced producer: {b['untraced_calls_per_s']:,} calls/s; traced flat out: {b['traced_calls_per_s']:,} calls/s; "
           f"cost per call on the traced process (both events): {b['per_call_cost_us']} µs", "",
           "| target rate | producer calls/s | file_io decoded/s | lost | block_io decoded/s | lost | of them without latency (completion unseen) | block events the kernel skipped, counted | all accounted |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in b["rates"]:
        out.append(f"| {r['target_rate']} | {r['producer_rate']:,} | {r['decoded_per_s']:,} | {r['lost']:,} | "
                   f"{r['block_decoded_per_s']:,} | {r['block_lost']:,} | {r.get('block_unseen', 0):,} | "
                   f"{sum(r['block_kernel_skips'].values()):,} | "
                   f"{r['accounted'] and r['block_accounted']} |")
    return out


def auto_markdown(a: dict) -> list[str]:
    out = ["", "## When in-kernel aggregation takes over (`--sampling auto`, the default; pread on tmpfs)", "",
           "| ring | target rate | producer calls/s | raw rows written | failed reserves | sampled | in-kernel file_agg calls |",
           "|---|---|---|---|---|---|---|"]
    for ring, rows in (("small", a["small_ring"]), ("default", a["default_ring"])):
        for r in rows:
            sampled = f"up to 1 in {r['max_n']} for {r['sampled_s']} s" if r["max_n"] > 1 else "no"
            out.append(f"| {r['ringbuf_pages']} pages | {r['target_rate']} | {r['producer_rate']:,} | {r['decoded_events']:,} | "
                       f"{r['lost']:,} | {sampled} | {r['agg_calls']:,} of {r['producer_calls']:,} calls |")
    for ring in ("small", "default"):
        t = a[f"takeover_{ring}_ring"]
        out.append(f"- {ring} ring: " + ("the agent kept up at every rate: no sampling" if t["first_sampled_rate"] is None else
                   f"raw events sampled from {t['first_sampled_producer_rate']:,} calls/s (target {t['first_sampled_rate']})"))
    out.append("- file_agg counts include the interpreter's own few start-up preads")
    return out


def accounted_total(acc: dict) -> float | None:
    """The accounted costs together, as a share of the server's CPU (None when one is missing)."""
    keys = ("bpf_pct_of_server_cpu", "hook_pct_of_server_cpu", "slow_path_pct_of_server_cpu", "metrics_pct_of_server_cpu")
    return sum(acc[k] for k in keys) if all(k in acc for k in keys) else None


def ab_markdown(v: dict, layout: str) -> list[str]:
    if "skipped" in v:
        return [f"- {layout}: skipped ({v['skipped']})"]
    r, t, c = v["tokens_per_s_ratio"], v["ttft_p50_ratio"], v["server_cpu_per_token_ratio"]
    return [
        f"- **{layout}**: {v['pairs']} B phases, each against the A phases either side of it, in one session, {v['requests']} shared-prefix requests per "
        f"round at concurrency {v['concurrency']}; B = `kvtrace attach --port` (all probes, hook injected, KV events, "
        f"/metrics, Parquet{', OTLP' if v['otlp'] else ''}); load average {v['load_average']:.1f}",
        f"  - tokens/s B/A: {r['mean']:.3f} (median {r['median']:.3f}, min {r['min']:.3f}, max {r['max']:.3f}, stdev "
        f"{r['stdev']:.3f}); A {v['tokens_per_s']['A']:,} and B {v['tokens_per_s']['B']:,} tokens/s on average "
        "(target: under 0.5% loss)",
        f"  - TTFT p50 B/A: {t['mean']:.3f} (min {t['min']:.3f}, max {t['max']:.3f}); failed requests: {v['errors']}",
        f"  - the server's own CPU time per token, B/A: user {c['user']['mean']:.3f} (min {c['user']['min']:.3f}, max "
        f"{c['user']['max']:.3f}), system {c['system']['mean']:.3f} (min {c['system']['min']:.3f}, max {c['system']['max']:.3f}); "
        "user and system by process: " + ", ".join(f"{g} {c[g]['mean']:.3f}" for g in ("api", "engine", "workers") if g in c),
        *([f"  - accounted (one more B phase, outside the ratios): kvtrace's BPF programs took {acc['bpf_cpu_ms']:,} ms "
           f"of CPU on every process's events"
           + (f" ({acc['bpf_all_pct_of_server_cpu']:.2f}% of the server's CPU), {acc['bpf_server_cpu_ms']:,} ms on the server's "
              "own" if "bpf_server_cpu_ms" in acc else "")
           + f": {acc['bpf_pct_of_server_cpu']:.2f}% of the server's {acc['server_cpu_s']} s; the hook "
           + (f"{acc['hook_pct_of_server_cpu']:.2f}% ({acc['steps_recorded']:,} steps at its cost per step, "
                 f"{acc.get('hook_frames', 0):,} marker writes)"
              if "hook_pct_of_server_cpu" in acc else "not estimated")
           + (f"; the system-call slow path {acc['slow_path_pct_of_server_cpu']:.2f}% ({acc['server_syscalls_per_s']:,} server "
              f"system calls a second, {acc['slow_path_ns']} ns more each"
              + (f", the median of {len(acc['slow_path_pairs_ns'])} getppid loops without and with a program that never runs; "
                 f"{acc['slow_path_with_agent_ns']} ns without and with the agent" if "slow_path_pairs_ns" in acc else "")
              + (f"; of it {acc['slow_path_sched_yield_pct_of_server_cpu']:.2f}% on sched_yield, OpenMP threads waiting at "
                 "a barrier, where it is an upper bound" if "slow_path_sched_yield_pct_of_server_cpu" in acc else "")
              + "; most frequent: " + ", ".join(f"{k} {c:,}/s" for k, c in list(acc.get("server_syscalls_top", {}).items())[:4])
              + ")" if "slow_path_ns" in acc else "")
           + (f"; /metrics scrapes {acc['metrics_pct_of_server_cpu']:.2f}% (one per {acc['scrape_interval_s']:g} s at "
              f"{acc['scrape_cpu_ms']} ms of the API server's CPU each; {acc['metrics_scrapes']} in the phase)"
              if acc.get("scrape_interval_s") else "")
           + (f"; total {total:.2f}%" if (total := accounted_total(acc)) is not None else "")
           + "; busiest programs: " + ", ".join(f"{b['program']} {b['ms']} ms" for b in acc["bpf_top"][:3])]
          if (acc := v.get("accounted")) else []),
        f"  - agent in steady state: CPU {v['agent_cpu_pct_of_core']['mean']:.1f}% of a core (max "
        f"{v['agent_cpu_pct_of_core']['max']:.1f}%), RSS {v['agent_rss_mib']['mean']} MiB mean, "
        f"{v['agent_rss_mib']['max']} MiB max (target 150 MB)",
    ]


def attach_markdown(a: dict) -> list[str]:
    out = ["", "## Live attach to a running vLLM server (bench/attach.py)", ""]
    if "skipped" in a:
        return out + [f"- skipped: {a['skipped']}"]
    s, n = a["summary"], len(a["trials"])
    fails = a.get("failures") or []
    if fails:
        out += [f"- **failed: {len(fails)} of {a['attaches_with_injection']} attaches that inject** (the server was "
                "restarted and the run went on): " + "; ".join(f"{x['where']}: {x['error'][:160]}" for x in fails)]
    if s is None:
        return out + ["- no attach trial completed"]

    def f(x, unit=" ms", nd=0):
        if x is None:
            return "n/a"
        v = f"{x['mean']:,.{nd}f}{unit}"
        return v if n == 1 else f"{v} (min {x['min']:,.{nd}f}, max {x['max']:,.{nd}f})"

    sp = s["split_ms"]
    out += [
        f"- `kvtrace attach --port` to the first `chunk` record, while 2 clients stream requests ({n} trial"
        f"{'s' if n > 1 else ''}, mean): **{f(s['attach_to_first_chunk_ms'])}**; of which start-up and imports "
        f"{f(sp['start_and_imports'])}, discovery {f(sp['discovery'])}, BPF build and load {f(sp['bpf_build_and_load'])}, "
        f"other set-up {f(sp['other_setup'])}, injection into EngineCore {f(sp['injection_engine'])} and Worker "
        f"{f(sp['injection_workers'])}; the first `step` record {f(sp['first_step_after_engine_injected'])} after the engine's "
        f"injection, the first chunk {f(sp['first_chunk_after_injection'])} after the Worker's (the next prefill of the stream)",
        f"- pause the server sees: longest gap between streamed tokens across the injection {f(s['injection_max_gap_ms'], nd=1)}"
        f" against a median gap of {f(s['baseline_median_gap_ms'], nd=1)} before the attach "
        f"({f(s['injection_max_over_median'], unit='×', nd=1)}); across the removal at detach {f(s['removal_max_gap_ms'], nd=1)}; "
        f"during the agent's BPF build (its compiler shares the CPU) {f(s.get('bpf_build_max_gap_ms'), nd=1)}; "
        f"hook's step records: median step gap {f(s['hook_median_step_gap_ms'], nd=1)}, longest across the Worker's "
        f"injection {f(s['hook_worker_injection_max_step_gap_ms'], nd=1)}"
        + (f"; load average {f(s['load_average'], unit='', nd=1)}" if s.get("load_average") else ""),
    ]
    t = a["throughput"]
    r = t["injected_over_plugin"]
    if r is None:
        return out + ["- injected hook against plugin hook: no complete pair of rounds"]
    steps = {m: [x["steps_recorded"] for x in t["rounds"] if x["mode"] == m and not x.get("failed")] for m in "IP"}
    out += [
        f"- injected hook against plugin hook, {t['complete_pairs']} pair{'s' if t['complete_pairs'] > 1 else ''} of rounds interleaved "
        f"(the shared-prefix round of bench/overhead.py, {t['requests']} requests at concurrency {t['concurrency']}, "
        f"an agent attached in both): tokens/s injected/plugin **{r['mean']:.3f}** (median {r.get('median', r['mean']):.3f}, "
        f"min {r['min']:.3f}, max {r['max']:.3f}, "
        f"stdev {r['stdev']:.3f}); injected {t['tokens_per_s']['injected']:,} and plugin {t['tokens_per_s']['plugin']:,} "
        f"tokens/s on average; step records per round {steps['I']} and {steps['P']}; failed requests {t['errors']}; "
        f"load average {t['load_average']:.1f}",
    ]
    return out


def parquet_markdown(p: dict) -> list[str]:
    out = ["", "## Parquet writes (bench/parquet.py, one flush's rows per part file: LZ4 parts, compacted to zstd)", "",
           "| table | rows | rows/s | rows per CPU s | MiB/s | bytes/row | compaction rows/s |", "|---|---|---|---|---|---|---|"]
    for name, r in p.items():
        out.append(f"| {name} | {r['rows']:,} | {r['rows_per_s']:,} | {r['rows_per_cpu_s']:,} | {r['mib_per_s']} | "
                   f"{r['bytes_per_row']} | {r['compact_rows_per_s']:,} |")
    return out


def correlate_markdown(c: dict) -> list[str]:
    g, h = c["export_grpc"], c["export_http"]
    return [
        "",
        f"## Correlation and OTLP export ({c['events']:,} recorded events, {c['requests']:,} requests, "
        f"{c['chunks']:,} chunks, {c['spans']:,} spans; load average {c['load_average']:.1f})",
        "",
        "| stage | per wall second | per CPU second |",
        "|---|---|---|",
        f"| correlation (events) | {c['events_per_s']:,} | {c['events_per_cpu_s']:,} |",
        f"| span build + encode (spans) | {c['build_and_encode_spans_per_s']:,} | {c['build_and_encode_spans_per_cpu_s']:,} |",
        f"| export over gRPC (spans) | {g['spans_per_s']:,} | {g['spans_per_cpu_s']:,} |",
        f"| export over HTTP/protobuf (spans) | {h['spans_per_s']:,} | {h['spans_per_cpu_s']:,} |",
        f"| encode + export, end to end (spans) | | gRPC {c['end_to_end_spans_per_cpu_s']['grpc']:,}, "
        f"HTTP {c['end_to_end_spans_per_cpu_s']['http']:,} |",
        "",
        f"- live (as attached, {c['live']['passes']} passes of {c['live']['slice_s']:g} s of events): "
        f"{c['live']['events_per_cpu_s']:,} events and {c['live']['spans_per_cpu_s']:,} spans per CPU second, "
        f"window at most {c['live']['max_window_rows']:,} rows, RSS growth {c['live']['rss_growth_mib']} MiB",
        f"- offline: peak RSS {c['peak_rss_mib']} MiB (the whole recorded run in memory: {c['rss_before_correlation_mib']} MiB "
        f"before correlating); encoded spans {c['encoded_bytes_mib']} MiB; dropped gRPC {g['dropped']}, HTTP {h['dropped']}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    a = ap.parse_args()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    results = {"date": dt.date.today().isoformat(), "machine": machine(), "short": a.short}
    runs = {name: (name, []) for name in BENCHES} | ({} if a.short else FULL_ONLY)
    for key, (name, extra) in runs.items():
        path = out / f"{key}{'-short' if a.short else ''}.json"
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--json", str(path), *extra] + (["--short"] if a.short else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        results[key] = json.loads(path.read_text())
    suffix = "-short" if a.short else ""
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"results{suffix}.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

