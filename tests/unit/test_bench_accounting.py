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


def test_syscall_names_from_the_c_header(tmp_path):
    h = tmp_path / "unistd_64.h"
    h.write_text("#define __NR_read 0\n#define __NR_write 1\n#define __NR_sched_yield 24\n#define __NR_getpid 39\n")
    names = overhead.syscall_names(str(h))
    assert names == {0: "read", 1: "write", 24: "sched_yield", 39: "getpid"}
    assert overhead.syscall_names(str(tmp_path / "none")) == {}


@pytest.mark.skipif(overhead.syscall_names().get(24) != "sched_yield", reason="needs x86_64's unistd_64.h")
def test_top_calls_per_second_and_the_yields():
    by_nr = {24: 3000, 0: 200, 1: 400, 39: 100}
    assert overhead.top_syscalls(by_nr, 2.0, n=3) == {"sched_yield": 1500, "write": 200, "read": 100}
    assert overhead.yields(by_nr) == 3000 and overhead.yields({0: 5}) == 0
