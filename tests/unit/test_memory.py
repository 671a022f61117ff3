"""kvtrace.capture.memory: code pages given back without changing what the process reads,
and glibc's mmap threshold fixed.  Each check runs in a fresh interpreter (it changes the
process's memory) and reads the kernel's own accounting (/proc/self/smaps, statm)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and madvise")


def run(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_file_mappings_parses_smaps(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(textwrap.dedent("""\
        7f0000000000-7f0000004000 r-xp 00000000 fe:01 123   /usr/lib/libx.so
        Size:                 16 kB
        Anonymous:             0 kB
        7f0000004000-7f0000006000 r--p 00004000 fe:01 123   /usr/lib/libx.so
        Anonymous:             4 kB
        7f0000010000-7f0000020000 rw-p 00000000 00:00 0
        Anonymous:            64 kB
        7f0000020000-7f0000021000 rw-s 00000000 00:0f 9    anon_inode:bpf-map
        Anonymous:             0 kB
        """))
    from kvtrace.capture.memory import file_mappings

    assert file_mappings(str(smaps)) == [
        (0x7F0000000000, 0x7F0000004000, "r-xp", "/usr/lib/libx.so", 0),
        (0x7F0000004000, 0x7F0000006000, "r--p", "/usr/lib/libx.so", 4),
    ]


def test_release_drops_touched_code_and_the_process_runs_on():
    out = run("""
        import pyarrow as pa, pyarrow.compute as pc
        from kvtrace.capture import memory
        released = memory.release_file_pages()
        # code used again is faulted back in: Arrow still computes
        print(released, pc.sum(pa.array(range(1000))).as_py())
    """)
    released, total = map(int, out.split())
    assert total == sum(range(1000))
    assert released > 4 << 20        # importing pyarrow alone leaves tens of MB of its code resident


def test_release_keeps_written_and_writable_pages(tmp_path):
    """A read-only private mapping holding a written (anonymous) page, like a library's
    relocated data after RELRO, keeps it; a writable private mapping is not touched; a clean
    read-only mapping reads back the file."""
    f = tmp_path / "data"
    f.write_bytes(b"A" * 8192 + b"B" * 8192)
    out = run(f"""
        import ctypes, mmap
        from kvtrace.capture import memory
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fobj = open({str(f)!r}, "rb")
        fd = fobj.fileno()
        relro = mmap.mmap(fd, 16384, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        relro[0:4] = b"RELO"                            # a copy-on-write page, then read-only
        addr = ctypes.addressof(ctypes.c_char.from_buffer(relro))
        assert libc.mprotect(addr, 16384, mmap.PROT_READ) == 0
        rw = mmap.mmap(fd, 16384, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        rw[8192:8196] = b"WRIT"
        ro = mmap.mmap(fd, 16384, mmap.MAP_PRIVATE, mmap.PROT_READ)
        assert ro[0] == ord("A") and ro[8192] == ord("B")
        anon = {{lo: a for lo, hi, perms, path, a in memory.file_mappings() if path == {str(f)!r}}}
        assert anon[addr] == 4, anon                    # the kernel's count of the written page
        memory.release_file_pages()
        print(bytes(relro[0:6]).decode(), bytes(rw[8192:8198]).decode(), bytes(ro[8190:8194]).decode())
    """)
    assert out.split() == ["RELOAA", "WRITBB", "AABB"]


HELD = """
    import ctypes
    from kvtrace.capture import memory
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if {tuned}:
        assert memory.tune_malloc()
    libc.free(libc.malloc(8 << 20))      # a big block freed: glibc's own threshold rises past 512 KiB
    blocks = [libc.malloc(512 << 10) for _ in range(40)]
    for b in blocks:
        ctypes.memset(b, 1, 512 << 10)   # resident
    before = memory.resident_bytes()
    for b in blocks[:-1]:                # the last one keeps the heap's top in place
        libc.free(b)
    print((before - memory.resident_bytes()) >> 20)
"""


def test_tune_malloc_gives_freed_blocks_back_at_once():
    """39 blocks of 512 KiB freed, the last kept: glibc, having raised its mmap threshold after a
    big free, took them from the heap and keeps them resident until a malloc_trim; with the
    threshold fixed at 128 KiB they were mmapped and go back on free (about 19.5 MiB)."""
    assert int(run(HELD.format(tuned=False))) < 2
    assert int(run(HELD.format(tuned=True))) >= 19
