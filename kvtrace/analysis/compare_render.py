"""`kvtrace compare` as a terminal table and as an HTML page with both runs in each plot."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from kvtrace.analysis.render import WIDE, Col, Term, _esc, bars


def value(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "share":
        return f"{100 * v:.2f}%"
    if unit == "s":
        return f"{v:.3f} s"
    if unit in ("tok/s", "tok"):
        return f"{v:,.1f}"
    if unit == "GB/s":
        return f"{v:.3f}"
    return f"{v:.3g}"


def delta(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "share":
        return f"{100 * v:+.2f} pt"
    if unit == "s":
        return f"{v:+.3f} s"
    if unit in ("tok/s", "tok"):
        return f"{v:+,.1f}"
    if unit == "GB/s":
        return f"{v:+.4f}"
    return f"{v:+,.3g}"


def terminal(result: dict, console: Console | None = None, wide: bool = False) -> None:
    c = console or (Console(width=WIDE) if wide else Console())
    t = Term(c, wide)
    b, n = result["base"], result["new"]
    c.print(f"[bold]kvtrace compare[/]  BASE {escape(str(b['dataset']))}  NEW {escape(str(n['dataset']))}")
    t.lines("•", [result["compared"],
                  f"BASE ({b.get('engine') or 'server not named'}): {b['requests']} requests, {b['prompt_tokens']:,} prompt and {b['output_tokens']:,} output tokens "
                  f"in {b['window_s']:.2f} s, bottleneck {b['bottleneck']}",
                  f"NEW ({n.get('engine') or 'server not named'}):  {n['requests']} requests, {n['prompt_tokens']:,} prompt and {n['output_tokens']:,} output tokens "
                  f"in {n['window_s']:.2f} s, bottleneck {n['bottleneck']}"])
    cols = [Col("figure", justify="left"), Col("BASE"), Col("NEW"), Col("delta"), Col("NEW/BASE", 1),
            Col("what", 3, justify="left", wrap="word")]
    shown = [f for f in result["figures"] if f["base"] or f["new"]]
    rows = [[f["figure"], value(f["base"], f["unit"]), value(f["new"], f["unit"]), delta(f["delta"], f["unit"]),
             "-" if f["ratio"] is None else f"{f['ratio']:.3f}", f["what"]] for f in shown]
    t.table("NEW against BASE", cols, rows)
    quiet = [f["figure"] for f in result["figures"] if f not in shown]
    if quiet:
        t.prose("  0 or none in both runs", ", ".join(quiet))
    if result["gates"]:
        t.table("Gates", [Col("gate", justify="left"), Col("change"), Col("result")],
                [[g["gate"], "-" if g["change"] is None else f"{g['change']:+.2f}{'%' if g['unit'] == '%' else ' ' + g['unit']}",
                  {True: "pass", False: "FAIL", None: "no figure"}[g["passed"]]] for g in result["gates"]])


PLOTS = [("Time to first token (s)", ("ttft_p50", "ttft_p90", "ttft_p99"), 1),
         ("Throughput (tokens/s)", ("prompt_tokens_per_s", "output_tokens_per_s"), 1),
         ("Prompt tokens hit (%)", ("hit_rate", "hit_rate_local", "hit_rate_storage"), 100),
         ("Why prompt tokens missed (% of prompt tokens)", ("miss_cold", "miss_unseen", "miss_evicted", "miss_inflight",
                                                             "miss_tail", "miss_other_key", "miss_not_looked_up", "miss_tier_partial",
                                                             "miss_other_engine", "miss_group", "miss_match_unit",
                                                             "miss_spec_dropped"), 100),
         ("Where chunk time went (%)", ("share_compute", "share_storage", "share_queueing"), 100)]


def _row(f: dict) -> str:
    ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
    cells = [f["figure"], value(f["base"], f["unit"]), value(f["new"], f["unit"]), delta(f["delta"], f["unit"]), ratio]
    return ("<tr>" + "".join(f"<td>{_esc(x)}</td>" for x in cells)
            + f"<td style='text-align:left'>{_esc(f['what'])}</td></tr>")


def to_html(result: dict) -> str:
    by = {f["figure"]: f for f in result["figures"]}
    plots = []
    for title, names, scale in PLOTS:
        names = [x for x in names if by[x]["base"] is not None or by[x]["new"] is not None]
        if names:
            plots.append(bars(title, [x.replace("miss_", "").replace("share_", "") for x in names],
                              {"BASE": [(by[x]["base"] or 0) * scale for x in names],
                               "NEW": [(by[x]["new"] or 0) * scale for x in names]}, stacked=False))
    head = "".join(f"<th>{h}</th>" for h in ("figure", "BASE", "NEW", "delta", "NEW/BASE", "what"))
    body = "".join(_row(f) for f in result["figures"])
    gates = "".join(f"<li>{_esc(g['gate'])}: {'pass' if g['passed'] else 'FAIL' if g['passed'] is False else 'no figure'}</li>"
                    for g in result["gates"])
    return "\n".join([
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvtrace compare</title><style>",
        "body{font-family:sans-serif;margin:24px;color:#222} table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:12px;text-align:right} th{background:#eee}"
        ".plot{margin:8px 12px 8px 0;border:1px solid #eee;background:#fff}",
        "</style></head><body>",
        f"<h1>kvtrace compare</h1><p>BASE {_esc(result['base']['dataset'])}<br>NEW {_esc(result['new']['dataset'])}</p>",
        f"<p>{_esc(result['compared'])}</p>", "<div>", *plots, "</div>",
        f"<table><tr>{head}</tr>{body}</table>", f"<h2>Gates</h2><ul>{gates or '<li>none</li>'}</ul>",
        "</body></html>"])
