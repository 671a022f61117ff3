"""`kvtrace summary DIR`: what a recorded dataset holds, per run and per table."""
from __future__ import annotations

import json
import textwrap

import click
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console

from kvtrace.dataset.reader import Dataset
from kvtrace.units import human_bytes


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def table_stats(t: pa.Table) -> dict:
    out = {"rows": t.num_rows}
    if t.num_rows == 0:
        return out
    if "bytes" in t.column_names:
        out["bytes"] = int(pc.sum(t["bytes"]).as_py() or 0)
    if "pid" in t.column_names:
        out["pids"] = sorted(set(pc.unique(t["pid"]).to_pylist()))
    if "latency_ns" in t.column_names:
        q = pc.quantile(t["latency_ns"], q=[0.5, 0.99], interpolation="nearest").to_pylist()
        out["latency_p50_ns"], out["latency_p99_ns"] = q
    return out


def summarize(ds: Dataset, run: str | None = None) -> dict:
    runs = [r for r in ds.runs() if run is None or r["run"] == run]
    tables = {}
    for name in ds.names():
        t = ds.table(name)
        if run is not None and "run" in t.column_names:
            t = t.filter(pc.equal(t["run"].cast(pa.string()), run))
        tables[name] = table_stats(t)
    return {"runs": runs, "tables": tables, "problems": ds.problems}


def _json_list(run: dict, key: str) -> list[dict]:
    """A run row's JSON list column (sinks, sidecars), its objects; [] when absent or unreadable."""
    try:
        items = json.loads(run.get(key) or "[]")
    except (TypeError, ValueError):
        return []
    return [s for s in items if isinstance(s, dict)] if isinstance(items, list) else []


def sink_lines(run: dict) -> list[str]:
    """One line per live sink of a run (the OTLP exporter): what it built, sent and dropped."""
    out = []
    for s in _json_list(run, "sinks"):
        if s.get("name") != "otlp":
            continue
        out.append(f"  otlp {s.get('protocol')} {s.get('url')}: {s.get('spans_built', 0)} spans built, "
                   f"{s.get('sent', 0)} sent, {s.get('dropped', 0)} dropped ({s.get('dropped_queue_full', 0)} queue full, "
                   f"{s.get('failed', 0)} failed, {s.get('rejected', 0)} rejected, "
                   f"{s.get('dropped_at_shutdown', 0)} at shutdown)")
    return out


def untraced_lines(run: dict) -> list[str]:
    """Completions the kernel did not run a probe for (it interrupted another BPF program on that
    CPU), counted all the same (kvtrace.capture.settle), and what was still open at the stop."""
    out = []
    skips = run.get("kernel_skips") or {}
    if skips:
        skips = {k: v for k, v in skips.items() if isinstance(v, int)}
        top = ", ".join(f"{k} {v}" for k, v in sorted(skips.items(), key=lambda kv: -kv[1])[:6])
        out.append(f"  kernel: {sum(skips.values())} events the kernel did not run kvtrace's program for "
                   f"(another BPF program held that CPU; its recursion_misses): {top}")
    for s in _json_list(run, "sidecars"):
        if s.get("name") == "nvme_queue" and (s.get("unseen") or s.get("open_at_stop")):
            out.append(f"  nvme: {s.get('completions', 0)} completions, {s.get('unseen', 0)} of them not traced "
                       f"(counted from the queue's next setup or the idle disk at the stop), "
                       f"{s.get('open_at_stop', 0)} commands still open at the stop")
        if s.get("name") == "io_agg" and (s.get("block_unseen_at_stop") or s.get("block_open_at_stop")):
            out.append(f"  block: {s.get('block_unseen_at_stop', 0)} request completions not traced (rows without "
                       f"latency, from the idle disk at the stop), {s.get('block_open_at_stop', 0)} still open")
    return out


def print_summary(ds: Dataset, run: str | None = None, console: Console | None = None) -> dict:
    console = console or Console(stderr=False)
    s = summarize(ds, run)
    for r in s["runs"]:
        print_run(console, r)
    print_tables(console, f"kvtrace summary of {ds.root}", s["tables"])
    return s   # files left out were named on stderr when the dataset was opened (--json lists them)


def print_run(console: Console, r: dict) -> None:
    """A run's line, then its pids, probes, skipped probes, sinks and untraced events, each
    wrapped under itself at the console's width.  To a pipe or a file the sink and untraced
    lines stay whole, one line each, for grep."""
    from kvtrace.analysis.render import Term  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    t = Term(console)
    lost = sum(v for v in (r.get("lost_events") or {}).values() if isinstance(v, (int, float)))
    console.print(f"run {r['run']} ({r.get('status') or '?'}): {(r['stop_ns'] - r['start_ns']) / 1e9:.1f} s, "
                  f"lost {lost}, dropped {r.get('dropped_events') or 0}", markup=False)
    if r.get("server_kind"):
        t.prose("  server", server_line(r))
    t.prose("  pids", ", ".join(map(str, r.get("pids") or [])))
    t.prose("  probes", ", ".join(map(str, r.get("probes_attached") or [])))
    for probe, why in (r.get("probes_skipped") or {}).items():
        if why != "not selected":
            t.prose(f"  skipped {probe}", str(why))
    for line in sink_lines(r) + untraced_lines(r):
        if console.is_terminal:
            line = textwrap.fill(line.strip(), console.width, initial_indent="  ", subsequent_indent="    ",
                                 break_on_hyphens=False)
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def server_line(r: dict) -> str:
    """The run row's server: its kind's title (the name itself when this kvtrace does not know
    the kind) and version."""
    from kvtrace.servers import registry  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    known = registry.KINDS.get(r["server_kind"])
    return f"{known.title if known else r['server_kind']} {r.get('server_version') or ''}".strip()


def print_tables(console: Console, title: str, tables: dict) -> None:
    """One row per table, fitted to the console's width (pids wrap; the least needed columns go
    first, and `kvtrace summary --json` has them)."""
    from kvtrace.analysis.render import Col, Term  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    def pids(st):
        p = st.get("pids", [])
        return ", ".join(map(str, p[:6])) + (f" (+{len(p) - 6})" if len(p) > 6 else "")

    cols = [Col("table", justify="left"), Col("rows"), Col("bytes", 1), Col("pids", 2, justify="left", wrap="word"),
            Col("p50 ms", 1), Col("p99 ms", 1)]
    rows = [[name, f"{st['rows']:,}", human_bytes(st["bytes"]) if "bytes" in st else "-", pids(st),
             _ms(st.get("latency_p50_ns")), _ms(st.get("latency_p99_ns"))] for name, st in tables.items()]
    Term(console, hint="kvtrace summary --json shows them").table(title, cols, rows)


@click.command("summary")
@click.argument("directory", type=click.Path())
@click.option("--run", default=None, help="Only this run id.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def command(directory, run, as_json) -> int:
    """Summarize a recorded dataset (no root needed)."""
    ds = Dataset.open(directory)
    ds.check_run(run)
    if as_json:
        click.echo(json.dumps(summarize(ds, run), indent=2, default=str))
    else:
        print_summary(ds, run)
    return 0
