"""The opt-in uprobe probe on user-space KV transfer libraries: planned only when asked for,
libraries found in the traced processes' maps, records decoded.  No root."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvtrace.capture import events, program, ulib
from kvtrace.capture.events import DecodeContext
from kvtrace.errors import UsageError
from kvtrace.attach import fabric as session
from kvtrace.host import tracefs


def test_planned_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.setattr(ulib, "requested", {})
    plan = program.plan(None, tp=lambda c, e: True)
    assert plan.skipped["ulib"] == "not asked for (--uprobe ucx|cufile|nixl)"
    # asked for: planned exactly when the tracefs has uprobe_events (this host's is not used)
    monkeypatch.setattr(ulib, "requested", {"ucx": None})
    monkeypatch.setattr(tracefs, "root", lambda: tmp_path)
    unavailable = ([], "uprobes unavailable (CONFIG_UPROBE_EVENTS off)")
    assert ulib.config(lambda c, e: True) == unavailable
    (tmp_path / "uprobe_events").touch()
    assert ulib.config(lambda c, e: True) == ([], None)
    monkeypatch.setattr(tracefs, "root", lambda: None)   # no tracefs mounted
    assert ulib.config(lambda c, e: True) == unavailable


def test_libraries_are_found_in_the_processes_maps():
    found = ulib.mapped([os.getpid()], ("libc.so", "libc-"))
    assert found and all(os.path.exists(p) for p in found)
    assert ulib.mapped([999999999], ("libc.so",)) == []


def test_uprobe_specs():
    assert session.parse_uprobes(["ucx", "cufile=/bin/sh"]) == {"ucx": None, "cufile": "/bin/sh"}
    with pytest.raises(UsageError, match="not one of cufile, nixl, ucx"):
        session.parse_uprobes(["verbs"])
    with pytest.raises(UsageError, match="no such file"):
        session.parse_uprobes(["ucx=/nonexistent/libucp.so"])


def test_decode():
    a = np.zeros(2, dtype=ulib.DTYPE)
    a["kind"], a["size"], a["tgid"], a["tid"] = events.KIND_ULIB, ulib.DTYPE.itemsize, 7, 8
    a["ts_entry"], a["ts"] = [100, 200], [150, 1200]
    a["func"], a["bytes"], a["arg"], a["ret"] = [1, 3], [4096, 1 << 20], [0xABC, 4096], [0, -5]
    rows = ulib.decode([a.tobytes()], DecodeContext()).to_pylist()
    assert [(r["lib"], r["func"], r["bytes"], r["latency_ns"], r["ret"]) for r in rows] == [
        ("ucx", "ucp_put_nbx", 4096, 50, 0), ("cufile", "cuFileRead", 1 << 20, 1000, -5)]


def test_a_wheels_renamed_ucx_is_found():
    """nixl-cu12's wheel maps UCX as libucp-<hash>.so.0.0.0 (auditwheel's rename)."""
    prefixes = ulib.LIBS["ucx"][0]
    assert "libucp-b39b3ed9.so.0.0.0".startswith(prefixes) and "libucp.so.0".startswith(prefixes)
    assert not "libucs.so.0".startswith(prefixes)
