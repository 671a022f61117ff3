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


def test_every_model_preset_is_written_as_given_and_fits_hookstep(tmp_path):
    """bench/overhead.py --model: the server's config.json is the preset itself, and
    bench/hookstep.py's KV spec (KV_HEADS heads of HEAD_SIZE) is the one every preset's layers have."""
    import json

    from kvtrace.demo.server import MODELS, write_tiny_model

    hookstep = pytest.importorskip("hookstep")
    assert set(MODELS) == {"tiny", "small"}
    for name, cfg in MODELS.items():
        d = write_tiny_model(tmp_path / name, cfg)
        assert json.loads((d / "config.json").read_text()) == cfg
        assert cfg["num_key_value_heads"] == hookstep.KV_HEADS == 4
        assert cfg["hidden_size"] // cfg["num_attention_heads"] == hookstep.HEAD_SIZE == 64
    assert MODELS["small"]["num_hidden_layers"] == 8 and MODELS["tiny"]["num_hidden_layers"] == 2


def test_an_unknown_model_is_refused_before_anything_starts(tmp_path):
    from kvtrace.demo.server import VllmServer

    s = VllmServer(workdir=tmp_path, model_name="huge", python="/nonexistent/python")
    with pytest.raises(ValueError, match="no model 'huge': use one of tiny, small"):
        s.start()
    assert s.proc is None and list(tmp_path.iterdir()) == []


def test_full_mode_report_of_the_small_model():
    """bench/run.py's full-mode table (CI runs only --short) from a recorded
    `bench/overhead.py --model small` run (2026-12-03 09:37): the model and its layer count are
    named, and each layout's accounted total is the sum of its four recorded shares."""
    import json

    run = pytest.importorskip("run")
    o = json.loads((Path(__file__).resolve().parents[1] / "data" / "bench-overhead-small.json").read_text())
    lines = run.overhead_markdown(o)
    assert lines[1] == "## Cost to a real vLLM server (bench/overhead.py, the small model)"
    assert "8 layer waits a Worker step" in lines[-1]
    text = "\n".join(lines)
    for key in ("vllm", "vllm_pinned"):
        acc = o[key]["accounted"]
        total = (acc["bpf_pct_of_server_cpu"] + acc["hook_pct_of_server_cpu"] + acc["slow_path_pct_of_server_cpu"]
                 + acc["metrics_pct_of_server_cpu"])
        assert f"; total {total:.2f}%" in text
    assert "; total 0.38%" in text and "; total 0.29%" in text   # as docs/performance.md gives them
