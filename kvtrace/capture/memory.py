"""Keep a long capture's resident memory down (glibc and Linux only; best effort elsewhere).

Three things, each measured on an attach to a serving vLLM (docs/performance.md):

- ``tune_malloc``: glibc raises its mmap threshold to as much as 32 MiB the first time a
  large block is freed, so Arrow's per-flush buffers then come from the heap and stay
  resident between trims.  A fixed threshold (128 KiB) gives them back at once.
- ``release_file_pages``: the pages of a library's code that were touched once (at import,
  at compile time) stay resident in this process although nothing runs them again.
  Dropping them from this process costs nothing lasting: a page used again is faulted back
  in from the page cache.  Only read-only private file mappings are touched; one holding
  no anonymous page (no relocation written into it, so the file holds exactly what is
  mapped) gets MADV_DONTNEED, which works even while other processes map the same pages;
  one that does hold some gets MADV_PAGEOUT, which drops only its clean file pages.
  Writable and shared mappings (the ring buffer) are never touched.
- ``release_compiler_memory``: the same for libLLVM and libclang after the BPF program is
  loaded, plus the C heap the compiler freed (malloc_trim).
"""
from __future__ import annotations

import ctypes
import mmap
import os

MADV_DONTNEED = 4
MADV_PAGEOUT = 21           # Linux 5.4+
M_TRIM_THRESHOLD = -1       # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 10
TRIM_THRESHOLD = 1 << 20


def trimming() -> bool:
    """False when KVTRACE_MEMORY_TRIM=0: no fixed thresholds and no start-up pages given back
    (to compare against, as tests/privileged/test_agent_memory.py does)."""
    return os.environ.get("KVTRACE_MEMORY_TRIM", "1") != "0"


def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def malloc_trim():
    """glibc's malloc_trim (call it with 0), or None where this libc has none."""
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds (before the big allocations start); False where
    this libc has no mallopt or refused."""
    libc = _libc()
    try:
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except AttributeError:
        return False


def file_mappings(smaps: str = "/proc/self/smaps") -> list[tuple[int, int, str, str, int]]:
    """(start, end, perms, path, anonymous KiB) of every file-backed mapping in smaps."""
    out = []
    with open(smaps) as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:   # a mapping's header line
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5] if len(parts) > 5 else ""
                out.append([lo, hi, parts[1], path, 0])
            elif parts[0] == "Anonymous:" and out:
                out[-1][4] = int(parts[1])
    return [tuple(m) for m in out if m[3].startswith("/")]


def release_file_pages(only=None) -> int:
    """Drop the resident pages of read-only private file mappings (see the module's doc);
    ``only(path)`` limits it to some files.  Returns the resident bytes released."""
    libc = _libc()
    if libc is None:
        return 0
    before = resident_bytes()
    import _imp

    _imp.acquire_lock()   # no import (dlopen, relocations) in another thread meanwhile
    try:
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for lo, hi, perms, path, anon in file_mappings():
            if "w" in perms or perms[3] != "p" or (only is not None and not only(path)):
                continue
            libc.madvise(lo, hi - lo, MADV_DONTNEED if anon == 0 else MADV_PAGEOUT)
    except (OSError, AttributeError, ValueError):
        pass
    finally:
        _imp.release_lock()
    return max(0, before - resident_bytes())


def release_compiler_memory() -> int:
    """After the BPF program is loaded: the compiler's freed heap and its libraries' pages."""
    before = resident_bytes()
    trim = malloc_trim()
    if trim is not None:
        trim(0)
    release_file_pages(only=lambda path: os.path.basename(path).startswith(("libLLVM", "libclang")))
    return max(0, before - resident_bytes())
