"""Reading the kernel's count of skipped program runs (recursion_misses) from the bytes of a
real ``struct bpf_prog_info``, recorded on this kernel with bpftool's reading beside it."""
from __future__ import annotations

import json
from pathlib import Path

from kvtrace.capture import progstats
from kvtrace.commands.summary import untraced_lines

RECORDED = json.loads((Path(__file__).parent.parent / "data" / "bpf_prog_info-6.18.json").read_text())


def test_recursion_misses_match_bpftool():
    info = bytes.fromhex(RECORDED["info_hex"])
    assert progstats.parse(info, RECORDED["info_len"]) == RECORDED["bpftool"]["recursion_misses"] == 22
    # the same buffer names the program bpftool named (bcc's name, cut to the kernel's 15 chars)
    assert info[64:80].split(b"\0")[0].decode() == RECORDED["bpftool"]["name"][len("tracepoint__"):][:15]


def test_older_kernels_without_the_field_say_none():
    info = bytes.fromhex(RECORDED["info_hex"])
    assert progstats.parse(info, 208) is None      # struct ended before recursion_misses (5.11)
    assert progstats.parse(info[:100], 232) is None


def test_event_names_and_sums():
    assert progstats.event_name("tracepoint__block__block_rq_complete") == "block:block_rq_complete"
    assert progstats.event_name("tracepoint__syscalls__sys_enter_pread64") == "syscalls:sys_enter_pread64"
    assert progstats.event_name("uprobe_cuFileRead") == "uprobe_cuFileRead"
    assert progstats.misses({}) == {}
    assert progstats.misses({"tracepoint__a__b": -1}) == {}   # a closed or bad fd: nothing, no error


def test_summary_names_the_skipped_events():
    (line,) = untraced_lines({"kernel_skips": {"block:block_rq_complete": 40, "syscalls:sys_enter_read": 2}})
    assert "42 events" in line and line.index("block:block_rq_complete 40") < line.index("syscalls:sys_enter_read 2")
    assert untraced_lines({"kernel_skips": {}}) == [] and untraced_lines({}) == []
