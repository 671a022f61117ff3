"""`kvtrace whatif`'s terminal table: the recording, the storage model fitted to it, then one row
of predictions per setting and the notes."""
from __future__ import annotations

from kvtrace.analysis.whatif.models import model_for


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.1f}"


def print_table(res: dict, wide: bool = False) -> None:
    from rich.console import Console

    from kvtrace.analysis.render import WIDE, Col, Term  # lazy: rich's console only for the terminal table

    c = Console(width=WIDE) if wide else Console()
    rec = res["recorded"]
    about = model_for(rec["engine"]).about
    if about:
        c.print(about.format(**rec))
    c.print(f"recorded: {res['requests']} requests, chunk budget ≥ {rec['chunk_size']}, block size {rec['block_size']}, "
            f"{rec['cache_blocks']} cache blocks ({rec['cache_blocks_from']}); hit rate "
            f"{_pct(rec['hit_rate'])}, {rec['evictions']:,} evictions, {rec['preemptions']} preemptions, "
            f"TTFT p50 {_ms(rec['ttft']['p50_ns'])} ms")
    sm = res["storage_model"]
    if sm["fitted_on_loads"]:
        gb = sm["recorded_read_gbps"]
        c.print(f"storage: {sm['block_bytes']:,} bytes a block; {sm['read_ns_per_block'] / 1e3:,.1f} µs reading it"
                + (f" ({gb:.3f} GB/s)" if gb else "") + f" + {sm['fixed_ns_per_block'] / 1e3:,.1f} µs of the connector's own, "
                f"from {sm['fitted_on_loads']} recorded loads")
    tm = res.get("tier_model")
    if tm:
        c.print(f"LMCache: {tm['chunk_tokens']} tokens a chunk, {tm['token_bytes']:,.0f} bytes a token, L1 "
                + (f"{tm['l1_bytes'] / (1 << 30):g} GiB" if tm["l1_bytes"] else "size not recorded (unbounded)")
                + f"; per token {tm['retrieve_ns_per_token']:,.0f} ns L1 -> the engine, {tm['l2_read_ns_per_token']:,.0f} ns "
                f"disk -> L1 (from {tm['fitted_on_retrieves']} retrieves and {tm['fitted_on_l2_reads']} L2 reads)")
    cols = [Col("chunk"), Col("block", 2), Col("cache blocks", 2), Col("tier", justify="left"), Col("hit rate"),
            Col("hit tokens (local+storage)", 3), Col("recomputed tokens", 3), Col("evictions", 2),
            Col("storage loads (blocks)", 3), Col("storage wait ms", 1), Col("TTFT p50 ms"), Col("TTFT p90 ms", 1),
            Col("output tok/s", 1), Col("preemptions", 3), Col("steps", 3)]
    rows = [[str(r["chunk_size"]), str(r["block_size"]), str(r["cache_blocks"]), r["storage_tier"],
             "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.2f}%",
             f"{r['hit_local']:,}+{r['hit_external']:,}", f"{r['recomputed_tokens']:,}", f"{r['evictions']:,}",
             f"{r['storage_loads']:,}", _ms(r["storage_wait_ns"]), _ms(r["ttft_p50_ns"]), _ms(r["ttft_p90_ns"]),
             "-" if r["output_tokens_per_s"] is None else f"{r['output_tokens_per_s']:,.1f}",
             str(r["preemptions"]), f"{r['steps']:,}"] for r in res["predictions"]]
    if any("tier_l1_chunks" in r for r in res["predictions"]):
        cols.insert(9, Col("LMCache chunks L1/L2", 2))
        for row, r in zip(rows, res["predictions"]):
            row.insert(9, f"{r['tier_l1_chunks']:,}/{r['tier_l2_chunks']:,}" if "tier_l1_chunks" in r else "-")
    Term(c, wide, hint="--json shows them").table("whatif: predictions per setting", cols, rows)
    for n in res["notes"]:
        c.print(f"note: {n}")
