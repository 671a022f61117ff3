"""What the kernel counts about kvtrace's own BPF programs: ``recursion_misses``.

The kernel does not run a tracepoint's BPF program while another BPF program runs on the
same CPU (``bpf_prog_active``, checked in ``trace_call_bpf``): for instance a completion in
softirq that interrupts a syscall program.  Since Linux 6.7 it counts each such skip in
the skipped program's ``recursion_misses`` (what ``bpftool prog show`` prints).  The
programs are kvtrace's own, loaded for this capture, so every miss is one of its events
not captured.  No bcc here: one ``bpf(BPF_OBJ_GET_INFO_BY_FD)`` per program.

Not every skip is counted: older kernels count none, and a tracepoint that fires inside
a BPF program in the same context is dropped by perf before the check.
"""
from __future__ import annotations

import ctypes
import platform
import struct

BPF_OBJ_GET_INFO_BY_FD = 15
SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}.get(platform.machine())
INFO_SIZE = 256           # our buffer; the kernel writes back how much of it it filled
RECURSION_MISSES = 208    # offsetof(struct bpf_prog_info, recursion_misses), uapi since 5.12

_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def parse(info: bytes, info_len: int) -> int | None:
    """recursion_misses from a ``struct bpf_prog_info`` the kernel filled ``info_len`` bytes of
    (None when this kernel's struct ends before the field)."""
    if info_len < RECURSION_MISSES + 8 or len(info) < RECURSION_MISSES + 8:
        return None
    return struct.unpack_from("<Q", info, RECURSION_MISSES)[0]


def recursion_misses(fd: int) -> int | None:
    """The program's recursion_misses, or None where the kernel cannot tell."""
    if SYS_BPF is None or not 0 <= fd < 2**31:
        return None
    buf = ctypes.create_string_buffer(INFO_SIZE)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", fd, INFO_SIZE, ctypes.addressof(buf)), 128)
    if _syscall()(SYS_BPF, BPF_OBJ_GET_INFO_BY_FD, attr, 16) != 0:
        return None
    info_len = struct.unpack_from("<I", attr.raw, 4)[0]
    return parse(buf.raw, info_len)


def event_name(func: str) -> str:
    """bcc's function name as the event it runs for: tracepoint__block__block_rq_complete →
    block:block_rq_complete (other names unchanged)."""
    if func.startswith("tracepoint__"):
        category, _, event = func[len("tracepoint__"):].partition("__")
        return f"{category}:{event}"
    return func


def misses(funcs: dict[str, int]) -> dict[str, int]:
    """{event: recursion_misses} over ``funcs`` ({bcc function name: program fd}), non-zero only."""
    out: dict[str, int] = {}
    for name, fd in funcs.items():
        n = recursion_misses(fd)
        if n:
            key = event_name(name)
            out[key] = out.get(key, 0) + n
    return out
