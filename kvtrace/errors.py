"""Typed errors, each mapped to an exit code; the CLI prints them as one line."""


class KvtraceError(Exception):
    """Base of every error kvtrace reports to the user (one line, no traceback)."""

    exit_code = 1


class UsageError(KvtraceError):
    """Bad arguments or input the user can fix."""

    exit_code = 2


class PrivilegeError(KvtraceError):
    """Missing root or capabilities; nothing was attached."""

    exit_code = 2


class TargetError(KvtraceError):
    """The process to trace does not exist, exited, or is not what was asked for."""

    exit_code = 3


class CaptureError(KvtraceError):
    """The kernel side could not be set up (compile, attach, headers, tracefs)."""

    exit_code = 4


class OutputError(KvtraceError):
    """The output cannot be written (permissions, disk full)."""

    exit_code = 5


class DatasetError(KvtraceError):
    """A recorded dataset is missing, unreadable or of another schema version."""

    exit_code = 6


class ExportError(KvtraceError):
    """Nothing reached the OTLP endpoint (down, refusing, or too slow for every request)."""

    exit_code = 7


class GateError(KvtraceError):
    """A --gate of `kvtrace compare` failed: NEW did not meet it against BASE."""

    exit_code = 8
