"""bench/overhead.py's charge of kvtrace's BPF run time to the server: a program on a system
call's tracepoint runs for every process's calls, and the server pays for its own."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
overhead = pytest.importorskip("overhead")


X86_ONLY = pytest.mark.skipif(not overhead.SYSCALL_NR, reason="system call numbers are listed for x86_64 only")


@X86_ONLY
def test_server_pays_its_calls_share_of_syscall_programs():
    runs = {7: (9_000, 900), 8: (3_000, 300), 9: (5_000, 50), 10: (2_000, 100)}
    where = {7: "sys_enter_read", 8: "sys_exit_pwrite64", 9: "block_rq_complete"}  # 10: no tracepoint known
    calls = {0: 300, 18: 600, 39: 10_000}   # read 300 of 900 runs; pwrite64 more calls than runs
    got = overhead.server_bpf_ns(runs, where, calls)
    assert got == pytest.approx(9_000 * 300 / 900 + 3_000 + 5_000 + 2_000)


@X86_ONLY
def test_no_calls_no_charge_for_syscall_programs():
    assert overhead.server_bpf_ns({1: (4_000, 40)}, {1: "sys_exit_write"}, {}) == 0.0
    assert overhead.server_bpf_ns({1: (4_000, 0)}, {1: "sys_exit_write"}, {}) == 4_000
