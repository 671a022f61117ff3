"""tracefs: where it is mounted and which tracepoints exist (read without bcc)."""
from __future__ import annotations

import os
from pathlib import Path

CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


def root() -> Path | None:
    """The mounted tracefs, or None."""
    for path in CANDIDATES:
        if (path / "events").is_dir():
            return path
    return None


def tracepoint_exists(category: str, event: str) -> bool:
    base = root()
    return bool(base) and (base / "events" / category / event).is_dir()


def category_exists(category: str) -> bool:
    base = root()
    return bool(base) and (base / "events" / category).is_dir()


def events_in(category: str) -> list[str]:
    base = root()
    if not base:
        return []
    path = base / "events" / category
    try:
        return sorted(e for e in os.listdir(path) if (path / e).is_dir())
    except OSError:
        return []


def tracepoint_format(category: str, event: str) -> str | None:
    base = root()
    if not base:
        return None
    try:
        return (base / "events" / category / event / "format").read_text()
    except OSError:
        return None


def has_field(category: str, event: str, field: str) -> bool:
    fmt = tracepoint_format(category, event) or ""
    return any(f" {field};" in line or f" {field}[" in line for line in fmt.splitlines() if "field:" in line)
