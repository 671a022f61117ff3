"""Draw the key plots of a kvtrace dataset as SVG, and as one PNG where Chromium is installed.

    python examples/plots.py DIR [OUTDIR]        (OUTDIR defaults to ./kvtrace-plots)

  chunk_time.svg         time of the slowest chunks split into queueing, storage wait and compute
                         (bar k = row k of `query.py DIR slowest_chunks`)
  hit_ratio.svg          prefix-cache hit ratio per request, local cache and storage (KV connector)
                         (bar k = row k of `query.py DIR requests`, in order of arrival)
  ttft_vs_hit_ratio.svg  time to first token against hit ratio, one point per request
  plots.html             the three on one page; plots.png its screenshot by headless Chromium

The numbers are those of the queries in examples/queries/; the bars are drawn by kvtrace's own
HTML report code (kvtrace.analysis.render, inline SVG), so no plotting library is needed.
"""
from __future__ import annotations

import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtrace.analysis.render import COLORS, bars

sys.path.insert(0, str(Path(__file__).resolve().parent))
from query import run  # noqa: E402

MAX_BARS = 30
W, H = 720, 280


def rows(dataset, name: str) -> list[dict]:
    cols, data = run(dataset, name)
    return [dict(zip(cols, r)) for r in data]


def scatter(title: str, points: list[tuple[float, float, str]], xlabel: str, ylabel: str, xmax: float = 100) -> str:
    """Points (x, y, tooltip) over [0, xmax] x [0, max y]."""
    left, right, top, bottom = 60, 20, 30, 45
    pw, ph = W - left - right, H - top - bottom
    ymax = max([y for _, y, _ in points] + [0]) * 1.1 or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{W}" height="{H}" role="img" aria-label="{html.escape(title)}">',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
           f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#333"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#333"/>',
           f'<text x="{left + pw / 2}" y="{H - 8}" text-anchor="middle" font-size="11">{html.escape(xlabel)}</text>',
           f'<text x="14" y="{top + ph / 2}" text-anchor="middle" font-size="11" transform="rotate(-90 14 {top + ph / 2})">'
           f'{html.escape(ylabel)}</text>']
    for k in range(5):
        x, y = left + pw * k / 4, top + ph - ph * k / 4
        out.append(f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle" font-size="10">{xmax * k / 4:g}</text>')
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{ymax * k / 4:.1f}</text>')
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>')
    for x, y, tip in points:
        out.append(f'<circle class="point" cx="{left + pw * x / xmax:.1f}" cy="{top + ph - ph * y / ymax:.1f}" r="5" '
                   f'fill="{COLORS["compute"]}" fill-opacity="0.7"><title>{html.escape(tip)}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def draw(dataset) -> dict[str, str]:
    """Plot name -> SVG text."""
    chunks = rows(dataset, "slowest_chunks")[:MAX_BARS]
    reqs = rows(dataset, "requests")
    shown = reqs[:MAX_BARS * 2]
    more = f" (first {len(shown)} of {len(reqs)})" if len(shown) < len(reqs) else ""
    return {
        "chunk_time": bars(f"Time per chunk, the {len(chunks)} slowest by rank (ms)", [str(k + 1) for k in range(len(chunks))],
                           {name: [c[f"{col}_ms"] for c in chunks] for name, col in
                            (("queueing", "queue"), ("storage", "storage"), ("compute", "compute"))}, " ms", w=W, h=H),
        "hit_ratio": bars(f"Hit ratio per request in order of arrival{more} (% of prompt tokens)",
                          [str(k + 1) for k in range(len(shown))],
                          {"hit": [100 * r["cached_local"] / r["prompt_len"] for r in shown],
                           "storage": [100 * r["cached_external"] / r["prompt_len"] for r in shown]}, "%", w=W, h=H),
        "ttft_vs_hit_ratio": scatter(f"TTFT against hit ratio ({len(reqs)} requests)",
                                     [(100 * r["hit_ratio"], r["ttft_ms"],
                                       f"{r['request']}: hit {100 * r['hit_ratio']:.1f}%, TTFT {r['ttft_ms']:.3f} ms") for r in reqs],
                                     "hit ratio (% of prompt tokens)", "TTFT (ms)"),
    }


def screenshot(page: Path, png: Path, width: int, height: int) -> bool:
    """plots.html -> plots.png by headless Chromium; False when no Chromium is installed."""
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if browser is None:
        return False
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
                        f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri()],
                       capture_output=True, timeout=120, check=True)
    return True


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    dataset, out = argv[0], Path(argv[1] if len(argv) > 1 else "kvtrace-plots")
    out.mkdir(parents=True, exist_ok=True)
    svgs = draw(dataset)
    for name, svg in svgs.items():
        (out / f"{name}.svg").write_text(svg)
        print(f"wrote {out / name}.svg")
    page = out / "plots.html"
    page.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvtrace plots</title>"
                    "<style>body{margin:0;font-family:sans-serif;background:#fff} svg{display:block}</style></head><body>"
                    + "".join(svgs.values()) + "</body></html>")
    print(f"wrote {page}")
    if screenshot(page.resolve(), (out / "plots.png").resolve(), W, H * len(svgs)):
        print(f"wrote {out / 'plots.png'} ({W}x{H * len(svgs)})")
    else:
        print("no Chromium found: no PNG (apt-get install chromium for one; the SVG files open in any browser)")


if __name__ == "__main__":
    main()
