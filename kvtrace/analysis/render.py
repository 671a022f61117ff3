"""The report for people: rich tables in the terminal, or one self-contained HTML page whose
plots are inline SVG drawn here (no scripts, no network: it opens anywhere, headless too)."""
from __future__ import annotations

import html
import json
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from kvtrace.analysis import fleet, handover
from kvtrace.servers import registry

COLORS = {"compute": "#4e79a7", "recompute": "#9c755f", "storage": "#e15759", "queueing": "#f28e2b",
          "sched": "#edc948", "lost": "#e15759", "reloaded": "#59a14f", "restored": "#76b7b2", "hit": "#59a14f",
          "computed": "#bab0ac"}


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def num(x) -> str:
    if x is None:
        return "-"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.3f}"


# ---------------------------------------------------------------------------------------------
# Terminal: every table fits the console's width.  What gives way first: text columns wrap at
# spaces (paths and endpoints fold), then request ids shrink to a unique suffix (a legend at the
# end maps each back to its full id), then the least important columns are left out (named
# under the table).  ``wide`` shows every column and full id, however wide the lines get.

WIDE = 10_000  # the console width of --wide: nothing is wrapped or cropped
TAIL = 8       # characters of a shortened request id at least (vLLM's random suffix)
KEEP = 12      # ids this short are shown whole


@dataclass
class Col:
    """A column: ``prio`` 0 is never left out, higher numbers go first (the rightmost of a tie
    first); ``wrap`` "" never wraps, "word" wraps at spaces, "fold" anywhere (paths)."""
    header: str
    prio: int = 0
    justify: str = "right"
    wrap: str = ""
    ids: bool = False  # request ids: shortened to a unique suffix when the full ones do not fit


def short_ids(ids, universe, tail: int = TAIL, keep: int = KEEP) -> dict[str, str]:
    """Full id -> short form: the id itself when it has at most ``keep`` characters, else '…' and
    its shortest suffix of at least ``tail`` characters found in no other id of ``universe`` (as
    a substring, so grepping for it finds this id alone)."""
    hay = "\n".join(sorted(set(universe) | set(ids)))
    out = {}
    for rid in ids:
        out[rid] = rid
        if len(rid) > keep:
            for n in range(tail, len(rid) - 1):
                if hay.count(rid[-n:]) == 1:
                    out[rid] = "…" + rid[-n:]
                    break
    return out


def _words(s: str) -> int:
    return max((cell_len(w) for w in s.split()), default=0)


def _min(col: Col, cells: list[str]) -> int:
    head = _words(col.header)
    if col.wrap == "word":
        return max([head] + [_words(s) for s in cells])
    if col.wrap == "fold":  # words wrap, and only words over 16 cells fold
        return max([head] + [min(_words(s), 16) for s in cells])
    return max([head] + [cell_len(s) for s in cells])


def fit(cols: list[Col], rows: list[list[str]], width: int, short=None):
    """(kept column indexes, their widths, whether ids are short) for a boxed table of ``width``
    columns at most: wrap first, then short ids (``short`` maps them), then leave columns out."""
    short = short or {}
    for use_short, drop in ((False, False), (True, True)):
        data = [[short.get(r[j], r[j]) if use_short and c.ids else r[j] for r in rows] for j, c in enumerate(cols)]
        keep = list(range(len(cols)))
        while True:
            mins = [_min(cols[j], data[j]) for j in keep]
            room = width - 3 * len(keep) - 1 - sum(mins)
            if room >= 0:
                maxs = [max([cell_len(cols[j].header)] + [cell_len(s) for s in data[j]]) for j in keep]
                return keep, _grow(mins, maxs, [cols[j].prio for j in keep], room), use_short
            out = [j for j in keep if cols[j].prio > 0]
            if not drop or not out:
                break
            keep.remove(max(out, key=lambda j: (cols[j].prio, j)))
    return keep, mins, True


def _grow(mins: list[int], maxs: list[int], prios: list[int], room: int) -> list[int]:
    """Spread ``room`` over the columns still below their natural width: the most important
    first, one cell at a time round the columns of one priority."""
    w = list(mins)
    for p in sorted(set(prios)):
        group = [i for i in range(len(w)) if prios[i] == p]
        while room and any(w[i] < maxs[i] for i in group):
            for i in group:
                if room and w[i] < maxs[i]:
                    w[i] += 1
                    room -= 1
    return w


class Term:
    """Tables and text fitted to one console: its width, and the request ids shown short so far
    (``universe``: every id they must stay unique among).  ``hint`` says, under a table that left
    columns out, where to see them."""

    def __init__(self, console: Console, wide: bool = False, universe=(), hint: str = "--wide shows them"):
        self.c, self.wide, self.universe, self.hint = console, wide, set(universe), hint
        self.legend: dict[str, str] = {}  # short -> full, in the order first shown

    def table(self, title: str, cols: list[Col], rows: list[list[str]], **kw) -> None:
        """Print ``rows`` (strings) under ``cols``, fitted to the width unless wide."""
        keep, widths, short = list(range(len(cols))), None, {}
        if not self.wide:
            ids = {r[j] for r in rows for j, c in enumerate(cols) if c.ids and r[j]}
            short = short_ids(ids, self.universe) if ids else {}
            keep, widths, use_short = fit(cols, rows, self.c.width, short)
            short = short if use_short else {}
        tight = widths is not None and sum(widths) + 3 * len(widths) + 1 > self.c.width
        t = Table(title=title, min_width=min(Text.from_markup(title).cell_len, self.c.width), **kw)
        for k, j in enumerate(keep):
            c = cols[j]
            t.add_column(escape(c.header), justify=c.justify, width=None if widths is None else widths[k],
                         overflow="fold" if c.wrap == "fold" or tight else "ellipsis", no_wrap=self.wide)
        for r in rows:
            t.add_row(*(escape(self._id(r[j], short) if cols[j].ids else r[j]) for j in keep))
        self.c.print(t)
        if len(keep) < len(cols):
            left = ", ".join(cols[j].header for j in range(len(cols)) if j not in keep)
            note = Text(f"(left out at {self.c.width} columns: {left}; {self.hint})", style="dim")
            self.c.print(Padding(note, (0, 0, 0, 2), expand=False))

    def _id(self, rid: str, short: dict[str, str]) -> str:
        s = short.get(rid, rid)
        if s != rid:
            self.legend.setdefault(s, rid)
        return s

    def lines(self, mark: str, items, style: str = "") -> None:
        """Items after a mark, wrapped with a hanging indent."""
        items = list(items)
        if not items:
            return
        g = Table.grid(padding=(0, 1))
        g.add_column(no_wrap=True, style=style)
        g.add_column(overflow="fold")
        for x in items:
            g.add_row(escape(mark), escape(str(x)))
        self.c.print(Padding(g, (0, 0, 0, 2), expand=False))

    def prose(self, label: str, text: str) -> None:
        """'label: text', the text wrapped under itself."""
        g = Table.grid(padding=(0, 1))
        g.add_column(no_wrap=True)
        g.add_column(overflow="fold")
        g.add_row(escape(label + ":"), escape(text))
        self.c.print(g)

    def print_legend(self) -> None:
        if not self.legend:
            return
        self.c.print("request ids shown by their unique last characters:")
        g = Table.grid(padding=(0, 2))
        g.add_column(no_wrap=True)
        g.add_column(overflow="fold")
        for s, full in self.legend.items():
            g.add_row(escape(s), escape(full))
        self.c.print(Padding(g, (0, 0, 0, 2), expand=False))


def request_ids(rep: dict) -> set[str]:
    """Every request id the report names (all of them are in its --json)."""
    out = {x["request"] for x in rep["reuse"]["per_request"]} | {x["request"] for x in rep["timing"]["per_chunk"]}
    out |= {x["request"] for x in rep["storage"].get("slow_chunks", [])}
    return {x for x in out if x}


def terminal(rep: dict, console: Console | None = None, rows: int = 10, wide: bool = False) -> None:
    """The report as rich tables, fitted to the console's width.  ``wide``: every column and full
    id, nothing wrapped, on a console of WIDE columns unless ``console`` is given (then as wide
    as that)."""
    c = console or (Console(width=WIDE) if wide else Console())
    t = Term(c, wide, request_ids(rep))
    _header(t, rep)
    _reuse(t, rep, rows)
    fleet.render(t, rep, num, pct, Col)
    handover.render(t, rep, num, pct, Col)
    _chunking(t, rep)
    _misses(t, rep, rows)
    _timing(t, rep)
    _slowest(t, rep, rows)
    _storage(t, rep, rows)
    _slow_chunk_fabric(t, rep)
    _tail(t, rep)
    t.print_legend()


def _header(t: Term, rep: dict) -> None:
    t.c.print(f"[bold]kvtrace analysis[/] of {escape(str(rep['dataset']))} ({rep['engine']}, {rep['elapsed_s']} s)")
    t.lines("•", rep["headline"])


def _reuse(t: Term, rep: dict, rows: int) -> None:
    r, nc = rep["reuse"], rep["reuse"]["not_counted"]
    cols = [Col("requests", 1), Col("prompt tokens", 1), Col("hit tokens", 1), Col("hit rate"), Col("local", 2),
            Col("storage", 2)]
    t.table("KV reuse (token-weighted, counted at first admission only)", cols,
            [[num(r["requests"]), num(r["prompt_tokens"]), num(r["hit_tokens"]), pct(r["hit_rate"]), pct(r["local_rate"]),
              pct(r["external_rate"])]])
    t.prose("  not counted as hits", f"{nc['readmission_reused_tokens']:,} tokens reused at {nc['readmissions']} "
            f"re-admissions, {nc['later_chunk_tokens']:,} in {nc['later_chunks']} later chunks")
    if rep.get("engines"):
        t.table("KV reuse per engine (data-parallel ranks; first admissions)",
                [Col("engine pid", 1), Col("requests", 1), Col("prompt tokens", 1), Col("hit tokens", 1), Col("hit rate"),
                 Col("evictions", 2)],
                [[str(e["engine_pid"]), num(e["requests"]), num(e["prompt_tokens"]), num(e["hit_tokens"]),
                  pct(e["hit_rate"]), num(e["evictions"])] for e in rep["engines"]])
    cols = [Col("chunk index"), Col("chunks", 1), Col("computed", 1), Col("hit credited", 1), Col("hit share")]
    t.table("Hit rate by chunk index (first admissions)", cols,
            [[str(x["chunk_index"]), num(x["chunks"]), num(x["computed"]), num(x["hit"]), pct(x["hit_share"])]
             for x in r["by_chunk_index"][:rows]])


def _chunking(t: Term, rep: dict) -> None:
    ch = rep["chunking"]
    pb, inf, ev = ch["partial_blocks"], ch["inflight"], ch["evictions"]
    d = ev["distance"]
    rows = [["non-final chunks ending mid-block", f"{pb['mid_block_ends']:,} of {pb['chunks_not_last']:,}"],
            ["tokens in partial blocks at chunk ends", num(pb["partial_tokens"])],
            ["prompt tail tokens (never cached)", num(ch["prompt_tails"]["tail_tokens"])],
            ["tokens missed: prefix still being computed by an in-flight request",
             f"{inf['missed_tokens']:,} ({inf['requests']} requests, {pct(inf['missed_rate'])} of prompt tokens)"],
            ["evictions / evicted blocks needed again", f"{ev['evictions']:,} / {ev['rereferenced']:,}"]]
    rows += [[f"  re-referenced and {k}", f"{v['blocks']:,} blocks ({v['tokens']:,} tokens)"]
             for k, v in sorted(ev["outcomes"].items())]
    rows += [[f"  KV cache group {g['kv_group']}: evictions / needed again / recomputed (thrash)",
              f"{g['evictions']:,} / {g['rereferenced']:,} / {g['thrash_blocks']:,} ({pct(g['thrash_rate'])})"]
             for g in ev.get("by_group", ())]
    rows.append(["eviction → re-reference p50 / p90 / p99 (ms)", f"{ms(d['dt_p50'])} / {ms(d['dt_p90'])} / {ms(d['dt_p99'])}"])
    t.table(f"Chunking versus blocks (block size {rep['block_size']})",
            [Col("figure", justify="left", wrap="word"), Col("value", wrap="word")], rows)


MISS_LABEL = {"miss_cold": "cold", "miss_unseen": "unseen", "miss_evicted": "evicted", "miss_inflight": "in flight",
              "miss_tail": "tail", "miss_other_key": "other key", "miss_not_looked_up": "not looked up",
              "miss_tier_partial": "tier partial chunk", "miss_other_engine": "on another engine",
              "miss_group": "cut by a KV cache group", "miss_match_unit": "below the match unit",
              "miss_spec_dropped": "dropped for the drafter"}


def _misses(t: Term, rep: dict, rows: int) -> None:
    m = rep["misses"]
    if not m["tokens"]:
        return
    kinds = [k for k in MISS_LABEL if m["first"].get(k)]
    t.table(f"Why prompt tokens missed ({m['requests']:,} requests, first admissions)",
            [Col("cause", justify="left"), Col("tokens"), Col("share of prompt tokens")],
            [["hit (local)", num(m["first"]["hit_local"]), pct(m["shares"]["hit_local"])],
             ["hit (storage)", num(m["first"]["hit_external"]), pct(m["shares"]["hit_external"])]]
            + [[MISS_LABEL[k], num(m["first"][k]), pct(m["shares"][k])] for k in kinds])
    ra, ev = m["readmissions"], m["evicted"]
    if ra["admissions"]:
        t.prose("  after preemption", f"{ra['admissions']} re-admissions: {ra['found_again']:,} tokens found again, "
                f"{ra['recomputed']:,} recomputed")
    if ev["blocks"]:
        t.prose("  evicted blocks needed", f"{ev['blocks']:,} blocks, evicted p50 {num(ev['distance_blocks_p50'])} "
                f"evictions / {ms((ev['distance_s_p50'] or 0) * 1e9)} ms before, by {ev['evicting_requests']} requests")
    if kinds:
        t.table("Missed tokens by chunk index (first admissions)", [Col("chunk index")] + [Col(MISS_LABEL[k], 1) for k in kinds],
                [[str(x["chunk_index"])] + [num(x.get(k, 0)) for k in kinds] for x in m["by_chunk_index"][:rows]])
    per = [r for r in m["per_request"] if any(r.get(k) for k in kinds)]
    if per and t.wide:
        t.table("Why each request's prompt tokens missed", [Col("request", justify="left")] + [Col(MISS_LABEL[k]) for k in kinds],
                [[r["request"]] + [num(r[k]) for k in kinds] for r in per[:rows]])


def _timing(t: Term, rep: dict) -> None:
    tm, v = rep["timing"], rep["verdict"]
    t.table(f"Time per chunk ({tm['chunks']:,} chunks): bottleneck [bold]{v['bottleneck']}[/]",
            [Col("component", justify="left"), Col("total ms"), Col("share")],
            [[k, ms(tm["components_ns"][k]), pct(tm["shares"][k])] for k in ("compute", "storage", "queueing")])
    t.lines("evidence:", v["evidence"])


def _slowest(t: Term, rep: dict, rows: int) -> None:
    slow = sorted(rep["timing"]["per_chunk"], key=lambda x: -x["total_ns"])[:rows]
    if not slow:
        return
    cols = [Col("request", justify="left", ids=True), Col("attempt", 3), Col("index", 2), Col("step", 1),
            Col("tokens", 2), Col("queue ms", 1), Col("sched ms", 4), Col("storage ms", 1), Col("compute ms", 1),
            Col("verdict", justify="left")]
    t.table("Slowest chunks", cols, [[x["request"], str(x["attempt"]), str(x["chunk_index"]), str(x["step"]),
                                      num(x["tok_len"]), ms(x["queue_ns"]), ms(x["sched_ns"]), ms(x["storage_ns"]),
                                      ms(x["compute_ns"]), x["verdict"]] for x in slow])


# file_map's kinds of rows (probe filemap): what mmap reads without a read system call
MAPPED = {"fill": "page-cache fill", "fault": "fault", "map": "fault-around"}


def _storage(t: Term, rep: dict, rows: int) -> None:
    st = rep["storage"]
    mapped = st.get("mapped_files") or []
    if not (st["block_io"] or st["nvme"] or st["files"] or st["kv_transfers"] or mapped):
        return

    def tail(x):
        return [ms(x["lat_p50"]), ms(x["lat_p95"]), ms(x["lat_p99"]), num((x["bytes_per_s"] or 0) / 1e6), num(x["iops"]),
                num(x["queue_depth"])]

    out = [["block", x["disk"], x["op"], num(x["ios"]), num(x["bytes"]), *tail(x)] for x in st["block_io"]]
    out += [[f"nvme {x['transport']}", f"{x['ctrl']} q{x['qid']}", x["opclass"], num(x["commands"]), num(x["bytes"]), *tail(x)]
            for x in st["nvme"]]
    files = sorted(st["files"], key=lambda x: -(x["bytes"] or 0))
    out += [["file", x["dir"], "read", num(x["reads"]), num(x["bytes"]), *tail(x)] for x in files[:rows]]
    out += [[f"kv {x['direction']}", f"{x['source']} ({x['kind']})", "", num(x["n"]), num(x["bytes"]), ms(x["lat_p50"]),
             ms(x["lat_p95"]), ms(x["lat_p99"]), "", "", ""] for x in st["kv_transfers"]]
    out += [["mapped files", f"{num(x['files'])} files", MAPPED.get(x["op"], x["op"]), num(x["events"]), num(x["bytes"]),
             "", "", "", "", "", ""] for x in mapped]
    cols = [Col("source", justify="left", wrap="word"), Col("device / queue", justify="left", wrap="fold"), Col("op", 1),
            Col("count", 1), Col("bytes", 2), Col("p50 ms", 1), Col("p95 ms", 3), Col("p99 ms", 1), Col("MB/s", 2),
            Col("IOPS", 3), Col("QD", 4)]
    t.table("Storage", cols, out)
    if len(files) > rows:
        t.c.print(f"  ({len(files) - rows} more directories of file reads in --json / --html)")


def _slow_chunk_fabric(t: Term, rep: dict) -> None:
    sc = [x for x in rep["storage"].get("slow_chunks", []) if x["nvme"] or x["nic"]]
    if not sc:
        return
    out = []
    for x in sc:
        nics = ", ".join(f"{n['device']}/{n['name']} {num(n['delta'])}" for n in x["nic"][:4])
        if len(x["nic"]) > 4:
            nics += f" (+{len(x['nic']) - 4})"
        for k, q in enumerate(x["nvme"] or [None]):
            head = [str(x["rank"]), x["request"], str(x["step"]), ms(x["total_ns"]), ms(x["storage_ns"]),
                    x["verdict"]] if k == 0 else [""] * 6
            qcols = [f"{q['ctrl']} q{q['qid']} {q['transport']}", num(q["commands"]), ms(q["latency_avg_ns"]),
                     ms(q["latency_max_ns"])] if q else ["-", "", "", ""]
            out.append([*head, *qcols, nics if k == 0 else ""])
    cols = [Col("#", 3), Col("request", justify="left", ids=True), Col("step", 1), Col("total ms", 3),
            Col("storage ms", 1), Col("verdict", 4, justify="left"), Col("NVMe queue", justify="left"), Col("cmds", 2),
            Col("avg ms", 1), Col("max ms", 2), Col("NIC counters", justify="left", wrap="word")]
    t.table("Slowest chunks: NVMe queues and NIC counters in their step", cols, out)


def _tail(t: Term, rep: dict) -> None:
    rr, pf, s, m = rep["reload_vs_recompute"], rep["prefetch"], rep["service"], rep["metrics"]
    t.prose("reload vs recompute", f"reload {num(_us(rr['reload']['ns_per_token']))} µs/token over "
            f"{rr['reload']['tokens']:,} tokens, recompute {num(_us(rr['recompute']['ns_per_token']))} µs/token "
            f"({rr['recompute']['basis']}); speed-up of the storage tier {_times(rr['speedup'])}")
    t.prose("prefetch", f"read {num(_us(pf['read_ns_per_block']))} µs/block; hideable read time "
            f"{ms(pf['reloaded_hideable_ns'])} ms for reloaded blocks (since eviction), "
            f"{ms(pf['from_arrival']['hideable_ns'])} ms of {ms(pf['from_arrival']['load_ns'])} ms (since arrival); "
            f"lost blocks a prefetch could have loaded instead: {ms(pf['lost_prefetchable_ns'])} ms of reads")
    t.prose("service", f"TTFT p50 {ms(s['ttft_p50_ns'])} ms, p99 {ms(s['ttft_p99_ns'])} ms over {s['requests']} requests; "
            f"{num(s['tokens_per_s'])} tokens/s ({num(s['output_tokens_per_s'])} output); storage read "
            + ", ".join(f"{k.replace('_bytes', '')} {v:.4f} GB/s" for k, v in s["storage_read_gb_per_s"].items()))
    if m.get("available"):
        titles = " and ".join(dict.fromkeys(registry.kind(e["name"]).title for e in rep["server"]["engines"])) \
            or "the server's"
        t.prose(f"{titles} /metrics", f"local hit rate {pct(m['local_hit_rate'])} (kvtrace local {pct(rep['reuse']['local_rate'])})")
        t.lines("why:", m["why_different"])
    t.lines("gap:", rep["gaps"], style="yellow")


def _times(x) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _us(ns):
    return None if ns is None else ns / 1e3


def to_json(rep: dict) -> str:
    return json.dumps(rep, indent=1, default=str)


# ---------------------------------------------------------------------------------------------
# SVG


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


def bars(title: str, labels: list[str], series: dict[str, list[float]], unit: str = "", stacked: bool = True,
         w: int = 640, h: int = 260) -> str:
    """A bar chart (stacked or grouped), one group per label."""
    left, bottom, top, right = 60, 50, 30, 120
    pw, ph = w - left - right, h - top - bottom
    n = max(len(labels), 1)
    totals = [sum(s[i] for s in series.values()) if stacked else max([s[i] for s in series.values()] or [0])
              for i in range(len(labels))]
    vmax = max(totals + [0]) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{w}" height="{h}" role="img" aria-label="{_esc(title)}">',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-weight="bold">{_esc(title)}</text>',
           f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#333"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#333"/>']
    for k in range(5):
        v = vmax * k / 4
        y = top + ph - ph * k / 4
        out.append(f'<text x="{left - 4}" y="{y + 4}" text-anchor="end" font-size="10">{_fmt(v)}{_esc(unit)}</text>')
        out.append(f'<line x1="{left}" y1="{y}" x2="{left + pw}" y2="{y}" stroke="#ddd"/>')
    gw = pw / n
    names = list(series)
    for i, lab in enumerate(labels):
        x0 = left + i * gw + gw * 0.1
        base = 0.0
        for j, name in enumerate(names):
            v = series[name][i]
            if stacked:
                hh = ph * v / vmax
                y = top + ph - ph * (base + v) / vmax
                out.append(f'<rect class="bar" x="{x0:.1f}" y="{y:.1f}" width="{gw * 0.8:.1f}" height="{hh:.1f}" '
                           f'fill="{COLORS.get(name, _palette(j))}"><title>{_esc(lab)} {_esc(name)}: {_fmt(v)}{_esc(unit)}</title></rect>')
                base += v
            else:
                bw = gw * 0.8 / len(names)
                hh = ph * v / vmax
                out.append(f'<rect class="bar" x="{x0 + j * bw:.1f}" y="{top + ph - hh:.1f}" width="{bw:.1f}" height="{hh:.1f}" '
                           f'fill="{COLORS.get(name, _palette(j))}"><title>{_esc(lab)} {_esc(name)}: {_fmt(v)}{_esc(unit)}</title></rect>')
        if n <= 24 or i % max(n // 24, 1) == 0:
            out.append(f'<text x="{x0 + gw * 0.4:.1f}" y="{top + ph + 14}" text-anchor="middle" font-size="10">{_esc(lab)}</text>')
    for j, name in enumerate(names):
        y = top + 14 * j
        out.append(f'<rect x="{left + pw + 10}" y="{y}" width="10" height="10" fill="{COLORS.get(name, _palette(j))}"/>'
                   f'<text x="{left + pw + 24}" y="{y + 9}" font-size="11">{_esc(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline(chunks: list[dict], w: int = 900, max_rows: int = 40) -> str:
    """Chunk timeline: one row per request, its queueing (light) and its chunks' steps coloured by verdict."""
    if not chunks:
        return "<p>no chunks</p>"
    reqs = []
    for c in chunks:
        if c["request"] not in reqs:
            reqs.append(c["request"])
    reqs = reqs[:max_rows]
    sel = [c for c in chunks if c["request"] in reqs]
    t0 = min(c["t_start_ns"] - c["queue_ns"] - c["sched_ns"] * 0 for c in sel)
    t1 = max(c["t_end_ns"] for c in sel)
    span = max(t1 - t0, 1)
    left, top, rh = 170, 30, 14
    h = top + rh * len(reqs) + 40
    pw = w - left - 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{w}" height="{h}" role="img" aria-label="chunk timeline">',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-weight="bold">Chunk timeline (first {len(reqs)} requests; '
           f'bars coloured by verdict, light = queueing)</text>']
    row = {r: i for i, r in enumerate(reqs)}
    for r, i in row.items():
        out.append(f'<text x="{left - 4}" y="{top + i * rh + 10}" text-anchor="end" font-size="9">{_esc(r[:28])}</text>')
    for c in sel:
        y = top + row[c["request"]] * rh
        xq = left + pw * (c["t_start_ns"] - c["queue_ns"] - t0) / span
        xs = left + pw * (c["t_start_ns"] - t0) / span
        xe = left + pw * (c["t_end_ns"] - t0) / span
        if c["queue_ns"]:
            out.append(f'<rect x="{xq:.1f}" y="{y + 3}" width="{max(xs - xq, 0.5):.1f}" height="{rh - 6}" fill="#f4d6a8"/>')
        out.append(f'<rect class="bar" x="{xs:.1f}" y="{y + 1}" width="{max(xe - xs, 1):.1f}" height="{rh - 2}" '
                   f'fill="{COLORS.get(c["verdict"], "#888")}"><title>{_esc(c["request"])} chunk {c["chunk_index"]} '
                   f'(attempt {c["attempt"]}) step {c["step"]}: tokens {c["tok_start"]}..{c["tok_start"] + c["tok_len"]}, '
                   f'queue {ms(c["queue_ns"])} ms, storage {ms(c["storage_ns"])} ms, compute {ms(c["compute_ns"])} ms</title></rect>')
    yb = top + rh * len(reqs) + 14
    for k in range(6):
        x = left + pw * k / 5
        out.append(f'<text x="{x:.1f}" y="{yb}" text-anchor="middle" font-size="10">{span * k / 5 / 1e6:.0f} ms</text>')
    out.append("</svg>")
    return "".join(out)


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 1:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _palette(i: int) -> str:
    return ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"][i % 8]


def plots(rep: dict) -> list[str]:
    out = [timeline(rep["timing"]["per_chunk"])]
    tm = rep["timing"]["components_ns"]
    out.append(bars("Time per chunk, summed (ms)", ["all chunks"],
                    {k: [tm[k] / 1e6] for k in ("compute", "storage", "queueing")}, " ms"))
    bi = rep["reuse"]["by_chunk_index"]
    out.append(bars("Hit rate by chunk index (first admissions; hits are credited to chunk 0)",
                    [str(x["chunk_index"]) for x in bi],
                    {"hit": [100 * (x["hit_share"] or 0) for x in bi]}, "%"))
    bs = rep["reuse"]["by_first_chunk_size"]
    out.append(bars("Hit rate by first-chunk size (tokens, upper edge)", [str(x["first_chunk_tokens_le"]) for x in bs],
                    {"hit": [100 * (x["hit_rate"] or 0) for x in bs]}, "%"))
    hist = rep["storage"]["latency_histogram"]
    devs = sorted({(x["source"], x["device"]) for x in hist})
    if devs:
        buckets = sorted({x["bucket"] for x in hist})
        labels = [(f"≤{b}µs" if b < 1000 else (f"≤{b // 1000}ms" if b < 1000000 else ">100ms")) for b in buckets]
        series = {f"{s}:{d}"[:40]: [sum(x["n"] for x in hist if (x["source"], x["device"]) == (s, d) and x["bucket"] == b)
                                    for b in buckets] for s, d in devs}
        out.append(bars("Read latency histogram per device / queue (count)", labels, series, "", stacked=False))
    rh = rep["chunking"]["evictions"]["histogram"]
    if rh:
        order = ["<1ms", "1-10ms", "10-100ms", "0.1-1s", "1-10s", ">=10s"]
        bk = [b for b in order if any(x["bucket"] == b for x in rh)]
        outcomes = sorted({x["outcome"] for x in rh})
        out.append(bars("Eviction → re-reference distance (blocks)", bk,
                        {o: [sum(x["blocks"] for x in rh if x["bucket"] == b and x["outcome"] == o) for b in bk] for o in outcomes}))
    return out


def to_html(rep: dict) -> str:
    def table(rows: list[dict], cols: list[str] | None = None, limit: int = 50) -> str:
        if not rows:
            return "<p><i>none</i></p>"
        cols = cols or list(rows[0])
        head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{_esc(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows[:limit])
        more = f"<p>{len(rows) - limit} more rows in --json</p>" if len(rows) > limit else ""
        return f"<table><tr>{head}</tr>{body}</table>{more}"

    r, ch, tm, v = rep["reuse"], rep["chunking"], rep["timing"], rep["verdict"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvtrace analysis</title><style>",
        "body{font-family:sans-serif;margin:24px;color:#222} table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:12px;text-align:right} th{background:#eee}"
        ".plot{margin:8px 12px 8px 0;border:1px solid #eee;background:#fff} .gap{color:#a15c00}",
        "</style></head><body>",
        f"<h1>kvtrace analysis</h1><p>{_esc(rep['dataset'])} — engine {_esc(rep['engine'])}, {rep['elapsed_s']} s</p><ul>",
        *[f"<li>{_esc(x)}</li>" for x in rep["headline"]], "</ul>",
        f"<h2>Bottleneck: {_esc(v['bottleneck'])}</h2><ul>", *[f"<li>{_esc(e)}</li>" for e in v["evidence"]], "</ul>",
        "<div>", *plots(rep), "</div>",
        "<h2>KV reuse (counted at first admission only)</h2>",
        table([{k: r[k] for k in ("requests", "prompt_tokens", "hit_tokens", "hit_local", "hit_external", "hit_rate",
                                  "local_rate", "external_rate")}]),
        "<p>Not counted as hits:</p>", table([r["not_counted"]]),
        table(r["per_request"], ["request", "prompt_len", "cached_local", "cached_external", "hit_rate", "readmissions", "readmit_reused"]),
        "<h2>Why prompt tokens missed (first admissions)</h2>",
        table([{k: rep["misses"]["first"][k] for k in rep["misses"]["first"]}]),
        table(rep["misses"]["by_chunk_index"]), table([rep["misses"]["evicted"]]),
        table(rep["misses"]["per_request"]),
        "<h2>Chunking versus blocks</h2>", table([ch["partial_blocks"] | ch["prompt_tails"]]),
        "<h3>Prefixes shared with in-flight requests</h3>", table(ch["inflight"]["rows"]),
        "<h3>Evictions</h3>", table([{k: ch["evictions"][k] for k in ("evictions", "rereferenced", "thrash_blocks", "thrash_tokens", "thrash_rate")}]),
        table([ch["evictions"]["distance"]]),
        "<h2>Time per chunk</h2>", table([tm["components_ns"] | {"chunks": tm["chunks"]}]),
        table(sorted(tm["per_chunk"], key=lambda x: -x["total_ns"]), limit=30),
        "<h2>Storage</h2>", table(rep["storage"]["block_io"]), table(rep["storage"]["nvme"]), table(rep["storage"]["files"]),
        table(rep["storage"]["kv_transfers"]), table(rep["storage"]["nic_during_slow_chunks"]),
        "<h3>Slowest chunks: NVMe queues and NIC counters in their step</h3>",
        table([{**{k: x[k] for k in ("rank", "request", "step", "total_ns", "storage_ns", "verdict")},
                "nvme": "; ".join(f"{q['ctrl']} q{q['qid']} {q['transport']}: {q['commands']} cmds, avg "
                                  f"{ms(q['latency_avg_ns'])} ms, max {ms(q['latency_max_ns'])} ms" for q in x["nvme"]),
                "nic": "; ".join(f"{n['device']}/{n['name']} {n['delta']}" for n in x["nic"])}
               for x in rep["storage"].get("slow_chunks", [])]),
        "<h2>Reload versus recompute</h2>",
        table([rep["reload_vs_recompute"]["reload"] | {"recompute_ns_per_token": rep["reload_vs_recompute"]["recompute"]["ns_per_token"],
                                                        "speedup": rep["reload_vs_recompute"]["speedup"]}]),
        "<h2>Prefetch opportunity</h2>", table([{k: v2 for k, v2 in rep["prefetch"].items() if not isinstance(v2, dict)}]),
        "<h2>Service</h2>", table([{k: v2 for k, v2 in rep["service"].items() if not isinstance(v2, (dict, list))}]),
        "<h2>Gaps</h2><ul>", *([f"<li class='gap'>{_esc(g)}</li>" for g in rep["gaps"]] or ["<li>none</li>"]), "</ul>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return "-"
    return str(v)
