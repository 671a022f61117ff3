"""`kvtrace compare BASE NEW`: two recorded runs side by side, with gates (no root, no bcc)."""
from __future__ import annotations

import json

import click

from kvtrace.dataset.writer import write_text
from kvtrace.errors import GateError


@click.command("compare")
@click.argument("base", type=click.Path())
@click.argument("new", type=click.Path())
@click.option("--gate", "gates", multiple=True, metavar="EXPR",
              help="FIGURE OP CHANGE that NEW must meet against BASE, e.g. 'ttft_p50<=-25%' or "
                   "'output_tokens_per_s>=+29%' (% of BASE), 'hit_rate>=+0.05' (absolute).  Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Also write a self-contained HTML page with both runs in each plot.")
@click.option("--wide", is_flag=True, help="Show every column, however wide the lines get.")
def command(base, new, gates, as_json, html_path, wide) -> int:
    """Compare two datasets: TTFT, throughput, hit rates, why tokens missed, storage bandwidth,
    reload against recompute, and where chunk time went; each figure with its delta and ratio.
    A gate that fails exits 8 (after printing the comparison)."""
    from kvtrace.analysis import compare, compare_render  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.analysis.report import analyze  # lazy: as above

    parsed = [compare.parse_gate(g) for g in gates]
    result = compare.compare(analyze(base), analyze(new), parsed)
    if html_path:
        write_text(html_path, compare_render.to_html(result))
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        compare_render.terminal(result, wide=wide)
    failed = [g for g in result["gates"] if g["passed"] is not True]
    if failed:
        g = failed[0]
        why = "a run lacks the figure" if g["passed"] is None else f"the change is {g['change']:+.4g}{g['unit'] if g['unit'] == '%' else ' ' + g['unit']}"
        raise GateError(f"gate {g['gate']} failed: {why}" + (f" ({len(failed) - 1} more failed)" if len(failed) > 1 else ""))
    return 0
