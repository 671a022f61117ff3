"""Build the one BPF program kvtrace loads: the shared header, every probe this kernel
supports, and static asserts that each event struct matches its Python mirror.

No bcc here: the text and the probe plan are plain data, so they are tested without root.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace import bpf
from kvtrace.capture import PROBES, events
from kvtrace.host import tracefs


@dataclass
class Plan:
    text: str
    cflags: list[str]
    ringbuf_pages: int
    attached: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def plan(
    wanted: list[str] | None = None,
    ringbuf_pages: int = 1024,
    trace_writes: bool = True,
    tp=tracefs.tracepoint_exists,
    extra: list | None = None,
    skip_fds: bool = False,
) -> Plan:
    """Select the probes this kernel supports; ``extra`` adds probe modules (e.g. user markers)."""
    cflags = [f"-I{bpf.SOURCE_DIR}", f"-DKV_RINGBUF_PAGES={ringbuf_pages}", "-Wno-macro-redefined"]
    parts = [bpf.source("kvtrace.h")]
    attached, skipped = [], {}
    if wanted is not None and "fileio" in wanted and "fdopen" not in wanted:
        wanted = [*wanted, "fdopen"]  # file reads are resolved to paths through the opens
    for probe in list(PROBES) + list(extra or []):
        if wanted is not None and probe.NAME not in wanted and probe.NAME != "proc":
            skipped[probe.NAME] = "not selected"
            continue
        if probe.NAME == "fileio":
            flags, why = probe.config(tp, trace_writes=trace_writes, skip_fds=skip_fds)
        else:
            flags, why = probe.config(tp)
        if why:
            skipped[probe.NAME] = why
            continue
        cflags += flags
        parts.append(f"/* ---- {probe.SOURCE} ---- */\n" + bpf.source(probe.SOURCE))
        parts.append(events.static_asserts(probe.STRUCT, probe.DTYPE))
        attached.append(probe.NAME)
    return Plan("\n".join(parts), cflags, ringbuf_pages, attached, skipped)
