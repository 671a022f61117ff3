"""The ``kvtrace`` command: one module per subcommand under kvtrace/commands/."""
from __future__ import annotations

import os
import sys

import click

from kvtrace import __version__, phases
from kvtrace.errors import KvtraceError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtrace")
def cli() -> None:
    """Trace KV-cache reuse, eviction and storage I/O of LLM serving (vLLM) with eBPF."""


COMMANDS = ("doctor", "attach", "summary", "demo", "servers", "inject", "correlate", "export", "analyze", "compare",
            "whatif")


def _register() -> None:
    import importlib

    for name in COMMANDS:
        module = importlib.import_module(f"kvtrace.commands.{name}")
        cli.add_command(module.command)


def _lean_allocator(args: list[str]) -> None:
    """For `kvtrace attach`, which runs for hours beside the server: Arrow on glibc's allocator,
    with fixed thresholds (kvtrace.capture.memory.tune_malloc).

    Arrow's default (mimalloc) keeps the pages of freed buffers; on glibc's, freed buffers go
    back, at once (above the mmap threshold) or at the pipeline's periodic malloc_trim
    (docs/performance.md).  Arrow picks its allocator once, when pyarrow is first imported,
    so this runs before the commands are imported; a value the user set is kept."""
    if args[:1] == ["attach"]:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
        from kvtrace.capture import memory  # lazy: only `attach` tunes the allocator, before pyarrow is first imported

        if memory.trimming():
            memory.tune_malloc()


def main(argv: list[str] | None = None) -> None:
    phases.mark("main")
    _lean_allocator(sys.argv[1:] if argv is None else list(argv))
    _register()
    try:
        rc = cli.main(args=argv, prog_name="kvtrace", standalone_mode=False)
    except KvtraceError as e:
        click.echo(f"kvtrace: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("kvtrace: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"kvtrace: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)
