"""Built-in I/O workloads with known answers, for the demo, the tests and the benchmarks.

Each reads a file or device in fixed chunks and reports exactly what it did (pid, tid,
calls, bytes), so a capture can be checked against the workload itself:

    python -m kvtrace.demo.io direct   --path /dev/loop0 --chunk 131072 --count 64
    python -m kvtrace.demo.io buffered --path /mnt/f      --chunk 65536
    python -m kvtrace.demo.io uring    --path /dev/loop0 --chunk 131072 --count 64
    python -m kvtrace.demo.io pread-loop --path /dev/shm/f --chunk 4096 --seconds 2
    python -m kvtrace.demo.io mixed    --path /dev/loop0 --chunk 131072 --count 32

io_uring is driven through raw system calls (no liburing), so nothing is compiled.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import struct
import sys
import threading
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_io_uring_setup, SYS_io_uring_enter = 425, 426
IORING_OP_READ = 22
IORING_ENTER_GETEVENTS = 1
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000


def _result(mode: str, path: str, calls: int, nbytes: int, chunk: int, **extra) -> dict:
    return {"mode": mode, "path": path, "pid": os.getpid(), "tid": threading.get_native_id(),
            "calls": calls, "bytes": nbytes, "chunk": chunk, **extra}


def read_direct(path: str, chunk: int, count: int) -> dict:
    """O_DIRECT preadv of ``count`` aligned chunks (one block request each, below max_sectors_kb)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)  # page aligned, as O_DIRECT needs
    total = 0
    try:
        for i in range(count):
            n = os.preadv(fd, [buf], i * chunk)
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    return _result("direct", path, count, total, chunk)


def read_buffered(path: str, chunk: int) -> dict:
    """Plain read(2) of the whole file through the page cache."""
    fd = os.open(path, os.O_RDONLY)
    total = calls = 0
    try:
        while True:
            b = os.read(fd, chunk)
            calls += 1
            if not b:
                break
            total += len(b)
    finally:
        os.close(fd)
    return _result("buffered", path, calls, total, chunk)


def read_mapped(path: str, chunk: int) -> dict:
    """mmap the whole file and read one byte of every page: no read system call, page faults
    only (the file's device and inode in the result, to find its faults)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        size = st.st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    total = 0
    try:
        for off in range(0, size, mmap.PAGESIZE):
            total += m[off] >= 0
    finally:
        m.close()
    return _result("mmap", path, 0, size, chunk, pages=total, dev_major=os.major(st.st_dev),
                   dev_minor=os.minor(st.st_dev), ino=st.st_ino, page_size=mmap.PAGESIZE)


class Uring:
    """A minimal io_uring (setup, one SQE at a time or a batch, reap CQEs) over raw syscalls."""

    def __init__(self, entries: int = 64):
        params = ctypes.create_string_buffer(120)
        fd = libc.syscall(SYS_io_uring_setup, ctypes.c_uint(entries), params)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        p = params.raw
        self.sq_entries, self.cq_entries = struct.unpack_from("<II", p, 0)
        sq = struct.unpack_from("<7I", p, 40)   # head tail ring_mask ring_entries flags dropped array
        cq = struct.unpack_from("<6I", p, 80)   # head tail ring_mask ring_entries overflow cqes
        self.sq_off, self.cq_off = sq, cq
        self.sq = mmap.mmap(fd, sq[6] + self.sq_entries * 4, offset=IORING_OFF_SQ_RING)
        self.cq = mmap.mmap(fd, cq[5] + self.cq_entries * 16, offset=IORING_OFF_CQ_RING)
        self.sqes = mmap.mmap(fd, self.sq_entries * 64, offset=IORING_OFF_SQES)

    def _u32(self, m, off, val=None):
        if val is None:
            return struct.unpack_from("<I", m, off)[0]
        struct.pack_into("<I", m, off, val)

    def submit_read(self, fd: int, addr: int, length: int, offset: int, user_data: int) -> None:
        head, tail, mask = (self._u32(self.sq, self.sq_off[i]) for i in (0, 1, 2))
        idx = tail & mask
        sqe = struct.pack("<BBHiQQIIQ", IORING_OP_READ, 0, 0, fd, offset, addr, length, 0, user_data) + bytes(24)
        self.sqes[idx * 64:(idx + 1) * 64] = sqe
        self._u32(self.sq, self.sq_off[6] + idx * 4, idx)
        self._u32(self.sq, self.sq_off[1], (tail + 1) & 0xFFFFFFFF)

    def enter(self, to_submit: int, min_complete: int) -> int:
        r = libc.syscall(SYS_io_uring_enter, self.fd, to_submit, min_complete, IORING_ENTER_GETEVENTS, None, 0)
        if r < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
        return r

    def reap(self) -> list[tuple[int, int]]:
        out = []
        head, tail, mask = (self._u32(self.cq, self.cq_off[i]) for i in (0, 1, 2))
        while head != tail:
            user_data, res, _flags = struct.unpack_from("<QiI", self.cq, self.cq_off[5] + (head & mask) * 16)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        self._u32(self.cq, self.cq_off[0], head)
        return out

    def close(self) -> None:
        for m in (self.sq, self.cq, self.sqes):
            m.close()
        os.close(self.fd)


def read_uring(path: str, chunk: int, count: int, direct: bool = True) -> dict:
    """``count`` IORING_OP_READ requests of ``chunk`` bytes, one in flight at a time."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buf = mmap.mmap(-1, chunk)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    ring = Uring(8)
    total, results = 0, []
    try:
        for i in range(count):
            ring.submit_read(fd, addr, chunk, i * chunk, user_data=1000 + i)
            ring.enter(1, 1)
            for user_data, res in ring.reap():
                results.append([user_data, res])
                total += max(res, 0)
    finally:
        ring.close()
        os.close(fd)
    return _result("uring", path, count, total, chunk, completions=results)


def pread_loop(path: str, chunk: int, seconds: float, rate: float = 0.0, direct: bool = False) -> dict:
    """pread as fast as possible (or at ``rate`` calls/s) for ``seconds``: the capacity benchmark.
    ``direct``: O_DIRECT preadv of aligned chunks, walking the file or device, so that every
    call is one block request."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    bufs = [mmap.mmap(-1, chunk)] if direct else []   # page aligned, as O_DIRECT needs
    span = max(os.lseek(fd, 0, os.SEEK_END) // chunk, 1) if direct else 1
    calls = total = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    try:
        while True:
            if direct:
                for i in range(calls, calls + 256):
                    total += os.preadv(fd, bufs, (i % span) * chunk)
            else:
                for _ in range(256):
                    total += len(os.pread(fd, chunk, 0))
            calls += 256
            now = time.perf_counter()
            if now >= end:
                break
            if rate:
                ahead = calls / rate - (now - t0)
                if ahead > 0:
                    time.sleep(ahead)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    return _result("pread-loop", path, calls, total, chunk, seconds=elapsed, rate=calls / elapsed, direct=direct)


def mixed(path: str, chunk: int, count: int) -> dict:
    """The demo's workload: O_DIRECT preadv, then io_uring reads, of the same device."""
    a = read_direct(path, chunk, count)
    b = read_uring(path, chunk, count)
    return _result("mixed", path, a["calls"] + b["calls"], a["bytes"] + b["bytes"], chunk, direct=a, uring=b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtrace.demo.io")
    ap.add_argument("mode", choices=["direct", "buffered", "uring", "pread-loop", "mixed", "mmap"])
    ap.add_argument("--path", required=True)
    ap.add_argument("--chunk", type=int, default=131072)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--direct", action="store_true", help="pread-loop: O_DIRECT preadv across the file or device")
    ap.add_argument("--result", help="write the result JSON here (default: stdout)")
    a = ap.parse_args(argv)
    try:
        if a.mode == "direct":
            r = read_direct(a.path, a.chunk, a.count)
        elif a.mode == "buffered":
            r = read_buffered(a.path, a.chunk)
        elif a.mode == "uring":
            r = read_uring(a.path, a.chunk, a.count)
        elif a.mode == "mixed":
            r = mixed(a.path, a.chunk, a.count)
        elif a.mode == "mmap":
            r = read_mapped(a.path, a.chunk)
        else:
            r = pread_loop(a.path, a.chunk, a.seconds, a.rate, a.direct)
    except OSError as e:
        print(f"workload: {a.mode} on {a.path}: {e.strerror or e}", file=sys.stderr)
        return 1
    text = json.dumps(r)
    if a.result:
        with open(a.result, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
