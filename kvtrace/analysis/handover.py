"""The prefill/decode section of `kvtrace analyze`: requests whose prompt one server computed
and another loaded over a KV connector (the handovers table, kvtrace.correlate.pd), the KV each
side counted, and TTFT split into queue, prefill, transfer (handoff + pull) and first decode.

FIGURES are SQL that kvtrace.analysis.queries runs with its own (same portability rules).
"""
from __future__ import annotations

PARTS = ("queue", "prefill", "handoff", "pull", "first_decode")

FIGURES: dict[str, str] = {
    "handovers": """SELECT run, p_host, COALESCE(connector, '') AS connector, COUNT(*) AS pairs,
        SUM(CASE WHEN how = 'request id' THEN 1 ELSE 0 END) AS by_request_id,
        SUM(p_blocks) AS p_blocks, SUM(d_blocks) AS d_blocks, SUM(p_bytes) AS p_bytes, SUM(d_bytes) AS d_bytes,
        SUM(CASE WHEN p_bytes = d_bytes THEN 0 ELSE 1 END) AS bytes_differ,
        SUM(d_transport_calls) AS transport_calls, SUM(d_transport_bytes) AS transport_bytes,
        SUM(CASE WHEN d_transport_calls IS NULL THEN 0 ELSE 1 END) AS transport_traced,
        MAX(clock_shift_ns) AS clock_shift_ns, MAX(clock_error_ns) AS clock_error_ns,
        SUM(CASE WHEN clock_error_ns IS NULL THEN 1 ELSE 0 END) AS unbounded,
        SUM(queue_ns) AS queue_ns, SUM(prefill_ns) AS prefill_ns, SUM(handoff_ns) AS handoff_ns,
        SUM(pull_ns) AS pull_ns, SUM(first_decode_ns) AS first_decode_ns, SUM(ttft_ns) AS ttft_ns,
        MAX(ttft_ns) AS ttft_max_ns, SUM(CASE WHEN ttft_ns IS NULL THEN 1 ELSE 0 END) AS untimed
        FROM handovers GROUP BY run, p_host, COALESCE(connector, '') ORDER BY run, p_host""",
}


def section(rows: dict[str, list[dict]]) -> dict | None:
    """Pairs, blocks and bytes on each side, the clocks' shift and error bound, and the mean of
    each part of TTFT (seconds; their shares of the mean TTFT); None without pairs."""
    groups = rows.get("handovers") or []
    if not groups:
        return None
    tot = {k: sum(int(g[k] or 0) for g in groups) for k in (
        "pairs", "by_request_id", "p_blocks", "d_blocks", "p_bytes", "d_bytes", "bytes_differ", "unbounded",
        "transport_calls", "transport_bytes", "transport_traced",
        "untimed", *(f"{p}_ns" for p in PARTS), "ttft_ns")}
    timed = tot["pairs"] - tot["untimed"]
    mean = {p: (tot[f"{p}_ns"] / timed / 1e9 if timed else None) for p in (*PARTS, "ttft")}
    share = {p: (tot[f"{p}_ns"] / tot["ttft_ns"] if tot["ttft_ns"] else None) for p in PARTS}
    return {"pairs": tot["pairs"], "by_request_id": tot["by_request_id"], "by_prompt": tot["pairs"] - tot["by_request_id"],
            "connectors": sorted({g["connector"] for g in groups if g["connector"]}),
            "blocks": {"prefill": tot["p_blocks"], "decode": tot["d_blocks"]},
            "bytes": {"prefill": tot["p_bytes"], "decode": tot["d_bytes"]}, "bytes_differ": tot["bytes_differ"],
            "transport": ({"pairs": tot["transport_traced"], "calls": tot["transport_calls"], "bytes": tot["transport_bytes"]}
                          if tot["transport_traced"] else None),
            "clocks": [{"run": g["run"], "prefill_host": g["p_host"], "shift_s": (g["clock_shift_ns"] or 0) / 1e9,
                        "error_s": (g["clock_error_ns"] / 1e9 if g["clock_error_ns"] is not None else None)}
                       for g in groups],
            "unbounded_clock": tot["unbounded"], "untimed": tot["untimed"],
            "ttft_mean_s": mean["ttft"], "ttft_max_s": max((g["ttft_max_ns"] or 0) for g in groups) / 1e9,
            "parts_mean_s": {p: mean[p] for p in PARTS}, "parts_share": share}


def render(t, rep: dict, num, pct, Col) -> None:
    """The prefill/decode tables on the terminal (kvtrace.analysis.render's Term)."""
    h = rep.get("handover")
    if not h:
        return
    def s(v):
        return "-" if v is None else f"{v:.3f}"
    t.table(f"Prefill/decode: {num(h['pairs'])} requests computed on one server and loaded on another "
            f"({', '.join(h['connectors']) or 'connector'}); KV handed over as each side counted it",
            [Col("", 1), Col("blocks", 2), Col("bytes", 2)],
            [["prefill side", num(h["blocks"]["prefill"]), num(h["bytes"]["prefill"])],
             ["decode side", num(h["blocks"]["decode"]), num(h["bytes"]["decode"])],
             *([[f"decode side's transport calls ({num(h['transport']['calls'])}, uprobes; "
                 f"{num(h['transport']['pairs'])} pairs)", "-", num(h["transport"]["bytes"])]] if h["transport"] else [])])
    t.table("TTFT split (mean seconds per request; share of TTFT)",
            [Col("queue", 1), Col("prefill", 1), Col("handoff", 1), Col("pull", 1), Col("first decode", 1), Col("TTFT", 1)],
            [[*(f"{s(h['parts_mean_s'][p])} ({pct(h['parts_share'][p])})" for p in PARTS), s(h["ttft_mean_s"])]])
    for c in h["clocks"]:
        if c["shift_s"] or c["error_s"]:
            t.prose("clocks", f"run {c['run']}: its clock shifted by {c['shift_s']:+.6f} s to the prefill host's "
                   f"({c['prefill_host']}), error bound " + (f"±{c['error_s']:.6f} s" if c["error_s"] is not None else "unknown"))
