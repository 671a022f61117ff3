"""`kvtrace whatif --html`: heat maps of predicted TTFT p50 and hit rate over chunk size (rows)
and storage tier (columns), one pair per block size and cache size swept."""
from __future__ import annotations

from kvtrace.analysis.render import _esc


def heatmap(title: str, rows: list, cols: list, cell: dict, fmt, w_cell: int = 110, h_cell: int = 34) -> str:
    vals = [v for v in cell.values() if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0, 1)
    left, top = 90, 48
    w, h = left + w_cell * len(cols) + 20, top + h_cell * len(rows) + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{w}" height="{h}" role="img" aria-label="{_esc(title)}">',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-weight="bold">{_esc(title)}</text>']
    for j, c in enumerate(cols):
        out.append(f'<text x="{left + w_cell * j + w_cell / 2}" y="{top - 8}" text-anchor="middle" font-size="12">{_esc(c)}</text>')
    for i, r in enumerate(rows):
        out.append(f'<text x="{left - 8}" y="{top + h_cell * i + h_cell / 2 + 4}" text-anchor="end" font-size="12">{_esc(r)}</text>')
        for j, c in enumerate(cols):
            v = cell.get((r, c))
            x = 0.5 if v is None or hi == lo else (v - lo) / (hi - lo)
            color = "#ddd" if v is None else f"rgb({int(255 * x)},{int(80 + 100 * (1 - x))},{int(255 * (1 - x))})"
            out.append(f'<rect x="{left + w_cell * j}" y="{top + h_cell * i}" width="{w_cell - 2}" height="{h_cell - 2}" '
                       f'fill="{color}"><title>{_esc(fmt(v))}</title></rect>')
            out.append(f'<text x="{left + w_cell * j + w_cell / 2}" y="{top + h_cell * i + h_cell / 2 + 4}" '
                       f'text-anchor="middle" font-size="12" fill="#fff">{_esc(fmt(v))}</text>')
    out.append("</svg>")
    return "".join(out)


def to_html(res: dict) -> str:
    preds = res["predictions"]
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvtrace whatif</title><style>",
             "body{font-family:sans-serif;margin:24px;color:#222} .plot{margin:8px 12px 8px 0;border:1px solid #eee}",
             "</style></head><body>", f"<h1>kvtrace whatif</h1><p>{_esc(res['dataset'])}: {res['requests']} requests</p>"]
    for b, n in dict.fromkeys((p["block_size"], p["cache_blocks"]) for p in preds):
        sel = [p for p in preds if (p["block_size"], p["cache_blocks"]) == (b, n)]
        rows = list(dict.fromkeys(p["chunk_size"] for p in sel))
        cols = list(dict.fromkeys(p["storage_tier"] for p in sel))
        ttft = {(p["chunk_size"], p["storage_tier"]): (p["ttft_p50_ns"] / 1e6 if p["ttft_p50_ns"] is not None else None)
                for p in sel}
        hit = {(p["chunk_size"], p["storage_tier"]): (100 * p["hit_rate"] if p["hit_rate"] is not None else None)
               for p in sel}
        parts.append(f"<h2>block size {b}, {n} cache blocks (rows: chunk size; columns: storage tier)</h2>")
        parts.append(heatmap("TTFT p50 (ms)", rows, cols, ttft, lambda v: "-" if v is None else f"{v:,.1f}"))
        parts.append(heatmap("hit rate (%)", rows, cols, hit, lambda v: "-" if v is None else f"{v:.1f}"))
    parts.append("</body></html>")
    return "\n".join(parts)
