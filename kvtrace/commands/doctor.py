"""`kvtrace doctor`: what this host offers and what kvtrace will do with it."""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from kvtrace.doctor import checks

STYLE = {checks.OK: "green", checks.MISSING: "red", checks.ABSENT_FINE: "yellow"}


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def command(as_json: bool) -> int:
    """Check privileges, tracefs, BTF, headers, bcc and tracepoint families, all at once.

    Exit 0 when capture can run, even with capabilities missing that cost other features
    (each is named with what it costs); 1 when it cannot."""
    report = checks.run_all()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    return 0 if report.capture_available else 1


def print_report(report: checks.Report) -> None:
    console = Console(width=max(Console().width, 140))
    console.print(_table(report))
    for cap in report.missing_capabilities:
        console.print(f"kvtrace: {cap['name']} missing: {cap['cost']}", highlight=False, soft_wrap=True)
    verdict = "capture available" if report.capture_available else "capture NOT available: fix the required rows above"
    console.print(f"kvtrace: {verdict}")


def _table(report: checks.Report) -> Table:
    table = Table(title="kvtrace doctor", show_lines=False)
    for col in ("check", "status", "detail", "used for"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        status = c.status + (" (required)" if c.required and not c.ok else "")
        table.add_row(c.name, f"[{STYLE[c.status]}]{status}[/]", c.detail, c.use)
    return table
