"""`kvtrace analyze` in a real terminal: tmux panes of 80 and 200 columns (its own tmux server
on a private socket, no user config), the report read back with capture-pane.  At 80 the
request ids are short and each maps back to one full id, no header or id is cut; at 200 the
full ids fit.  Skipped where tmux is not installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .test_terminal_width import (IDS, SHORT, SLOW, SLOW_COLS, assert_nothing_truncated, by_title, legend, parse_tables,
                                  vllm_dataset)

REPO = Path(__file__).resolve().parents[2]
KVTRACE = REPO / ".venv" / "bin" / "kvtrace"
DONE = "KVTRACE-TMUX-DONE"

pytestmark = pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed (apt-get install tmux)")


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return vllm_dataset(tmp_path_factory.mktemp("tmux") / "ds")


def pane(ds: Path, width: int, timeout: float = 240) -> str:
    """The whole pane (scrollback included) after `kvtrace analyze DS` ran in a detached tmux
    session of ``width`` x 50, without $COLUMNS: rich asks the terminal."""
    if not KVTRACE.exists():
        pytest.skip(f"{KVTRACE} is missing (the venv of the checkout)")
    sock = f"kvtrace-test-{os.getpid()}-{width}"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
    env["LANG"] = "C.UTF-8"
    tmux = ["tmux", "-u", "-L", sock, "-f", "/dev/null"]
    cmd = f"{KVTRACE} analyze {ds}; echo {DONE} $?; sleep 600"
    subprocess.run([*tmux, "new-session", "-d", "-x", str(width), "-y", "50", cmd], env=env, check=True, timeout=30)
    try:
        subprocess.run([*tmux, "set-option", "-g", "history-limit", "5000"], env=env, check=True, timeout=30)
        deadline = time.monotonic() + timeout
        while True:
            text = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-", "-E", "-"], env=env, capture_output=True,
                                  text=True, check=True, timeout=30).stdout
            if f"{DONE} " in text:
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.5)
    finally:
        subprocess.run([*tmux, "kill-server"], env=env, timeout=30)
    out, _, rc = text.partition(f"{DONE} ")
    assert rc.split()[0] == "0", out[-2000:]
    return out


def test_pane_of_80_columns(ds):
    text = pane(ds, 80)
    assert text.startswith("kvtrace analysis of ")
    assert max(len(line) for line in text.splitlines()) <= 80
    tables = parse_tables(text)
    assert len(tables) == 7
    assert_nothing_truncated(tables)
    slow = by_title(text)["Slowest chunks"]
    assert slow["headers"] == [c for c in SLOW_COLS if c not in ("attempt", "sched ms")]
    assert [line[0] for line in slow["body"]] == [SHORT[r] for r, _, _ in SLOW]
    assert legend(text) == {SHORT[k]: IDS[k] for k in IDS}
    for s in {line[0] for line in slow["body"]}:
        assert sum(s[1:] in full for full in IDS.values()) == 1


def test_pane_of_200_columns(ds):
    text = pane(ds, 200)
    assert max(len(line) for line in text.splitlines()) <= 200
    tables = parse_tables(text)
    assert_nothing_truncated(tables)
    assert not [t for t in tables if t["note"]] and legend(text) == {}
    slow = by_title(text)["Slowest chunks"]
    assert slow["headers"] == SLOW_COLS
    assert [line[0] for line in slow["body"]] == [IDS[r] for r, _, _ in SLOW]
