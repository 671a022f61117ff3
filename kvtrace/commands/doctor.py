"""`kvtrace doctor`: what this host offers and what kvtrace will do with it."""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from kvtrace.host import checks

STYLE = {checks.OK: "green", checks.MISSING: "red", checks.ABSENT_FINE: "yellow"}


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def command(as_json: bool) -> int:
    """Check privileges, tracefs, BTF, headers, bcc and tracepoint families, all at once."""
    report = checks.run_all()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        table = Table(title="kvtrace doctor", show_lines=False)
        for col in ("check", "status", "detail", "used for"):
            table.add_column(col, overflow="fold")
        for c in report.checks:
            status = c.status + (" (required)" if c.required and not c.ok else "")
            table.add_row(c.name, f"[{STYLE[c.status]}]{status}[/]", c.detail, c.use)
        console = Console(width=max(Console().width, 140))
        console.print(table)
        verdict = "capture available" if report.capture_available else "capture NOT available: fix the required rows above"
        console.print(f"kvtrace: {verdict}")
    return 0 if report.capture_available else 1
