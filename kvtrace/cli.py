"""The ``kvtrace`` command: one module per subcommand under kvtrace/commands/."""
from __future__ import annotations

import errno
import os
import signal
import sys

import click

from kvtrace import __version__, phases
from kvtrace.errors import KvtraceError, OutputError


class _StdoutFailed(Exception):
    """A write to stdout failed (kept from click, which would end a closed pipe with exit 1)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as e:
            if _stdout_failed(e):
                raise _StdoutFailed(e) from None
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
    import rich.console  # lazy: imported by the commands already (_register)

    rich.console.Console.on_broken_pipe = _pipe_closed
    sys.exit(_flushed(_run(argv)))


def _run(argv: list[str] | None) -> int:
    """The command's exit code; every error it raises as one line on stderr."""
    try:
        rc = cli.main(args=argv, prog_name="kvtrace", standalone_mode=False)
    except KvtraceError as e:
        click.echo(f"kvtrace: {e}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("kvtrace: aborted", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"kvtrace: {e.format_message()}", err=True)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except _StdoutFailed as e:
        return _stdout_error(e.error)
    except OSError as e:  # outside a command: --help, --version
        if not _stdout_failed(e):
            raise
        return _stdout_error(e)
    return rc if isinstance(rc, int) else 0


def _flushed(code: int) -> int:
    """code, once what the command printed is out; a stdout that cannot take it (a full disk, a
    closed pipe) is reported as the command's failure when it had none."""
    try:
        sys.stdout.flush()
    except OSError as e:
        if not _stdout_failed(e):
            raise
        return _stdout_error(e) if code == 0 else _silenced(code)
    return code


# What writing to stdout fails with when the output cannot take it: a full disk or device
# (`> /dev/full`), a quota, a file too large, an I/O error, a reader that closed the pipe.
STDOUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EPIPE)
SIGPIPE_EXIT = 128 + signal.SIGPIPE  # what a shell reports for a filter killed by SIGPIPE


def _pipe_closed(console) -> None:
    """rich's Console on a closed pipe (it would exit 1, which means "a check failed" here): the
    same error as any other write to it, for _stdout_error."""
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def _stdout_failed(e: OSError) -> bool:
    """A write to stdout failed (an OSError of a named file is not stdout's)."""
    return e.errno in STDOUT_ERRNOS and e.filename is None


def _stdout_error(e: OSError) -> int:
    """Exit 5 with one line (a closed pipe, as `| head` does: quietly, exit 141, like SIGPIPE)."""
    if e.errno == errno.EPIPE:
        return _silenced(SIGPIPE_EXIT)
    click.echo(f"kvtrace: cannot write the output to stdout: {e.strerror}; what was written before it stays", err=True)
    return _silenced(OutputError.exit_code)


def _silenced(code: int) -> int:
    """code, with stdout pointed at /dev/null: what Python still holds for it is dropped there
    instead of failing again (a traceback) when the interpreter exits."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass
    return code
