"""The event header every probe emits (struct kv_hdr in probes/kvtrace.h) and helpers to
mirror C structs as numpy dtypes, decode batches of raw events and check the mirrors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

KIND_BLOCK, KIND_FILEIO, KIND_FDOPEN, KIND_URING, KIND_PROC, KIND_USER = 1, 2, 3, 4, 5, 6
KIND_NVME, KIND_TCP, KIND_RDMA, KIND_ULIB, KIND_FILEMAP = 7, 8, 9, 10, 11
NKINDS = 16

# struct kv_hdr: (field, numpy type); the C name of each field is "h.<field>".
HEADER = [
    ("kind", "u1"),
    ("version", "u1"),
    ("size", "<u2"),
    ("cpu", "<u4"),
    ("ts", "<u8"),
    ("tgid", "<u4"),
    ("tid", "<u4"),
]
HEADER_FIELDS = {name for name, _ in HEADER}


def struct_dtype(fields: list[tuple[str, str]]) -> np.dtype:
    """A packed dtype of the header followed by ``fields`` (C layout is already aligned)."""
    return np.dtype(HEADER + fields)


def c_name(field_name: str) -> str:
    return f"h.{field_name}" if field_name in HEADER_FIELDS else field_name


def static_asserts(struct: str, dtype: np.dtype) -> str:
    """C _Static_asserts that the BPF struct has exactly the layout of its Python mirror."""
    lines = [f'_Static_assert(sizeof(struct {struct}) == {dtype.itemsize}, "{struct}: size differs from kvtrace/capture mirror");']
    for name in dtype.names:
        if name.startswith("pad"):
            continue
        off = dtype.fields[name][1]
        lines.append(
            f'_Static_assert(__builtin_offsetof(struct {struct}, {c_name(name)}) == {off}, "{struct}.{name}: offset differs from mirror");'
        )
    return "\n".join(lines)


def decode_array(raw: list[bytes], dtype: np.dtype) -> np.ndarray:
    """Concatenate same-kind records into one structured array.

    An item is one record, or a run of records back to back (the ring reader's bulk cut);
    an item whose length is not a multiple of the record size is dropped (counted by the
    pipeline as malformed).
    """
    size = dtype.itemsize
    good = [r for r in raw if r and len(r) % size == 0]
    if not good:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(b"".join(good), dtype=dtype)


def weights(col: np.ndarray) -> np.ndarray:
    """Sampling weights of raw events (events each row stands for); 0 in records written
    before the field existed (it was padding) means 1."""
    return np.maximum(col.astype(np.uint32), 1)


def cstr(col: np.ndarray) -> list[str]:
    """Fixed-size C char arrays (numpy 'S') to Python strings, cut at the first NUL."""
    return [b.split(b"\0", 1)[0].decode("utf-8", "replace") for b in col.tolist()]


@dataclass
class DecodeContext:
    """State decoders share across batches: fd→path table, device names, process comms."""

    fd_paths: dict[tuple[int, int], str] = field(default_factory=dict)
    cwd: dict[int, str] = field(default_factory=dict)
    dev_names: dict[int, str] = field(default_factory=dict)
    malformed: int = 0      # ring-buffer records of no known kind, or of the wrong size
    bad_frames: int = 0     # hook marker frames the probe could not copy (or not frames)
    # The NVMe topology, kept here by the fabric sidecar (kvtrace.attach.fabric.TopologyWatcher):
    # controllers by ctrl_id, the whole topology, the logical block size of every namespace
    # seen in the run ((ctrl_id, nsid) -> bytes, kept after it vanishes), and a callback that
    # rescans sysfs at once (rate-limited) when records name controllers, namespaces or disks the
    # topology does not list yet: ``nvme_rescan(ctrls=..., namespaces=..., devs=...)``.
    nvme_ctrls: dict = field(default_factory=dict)
    nvme_topology: object = None
    nvme_lba: dict[tuple[int, int], int] = field(default_factory=dict)
    nvme_rescan: Callable | None = None
    # ``skip_fd(pid, fd)``: tell the fileio probe a descriptor is not a file (kvtrace.capture.fdskip)
    skip_fd: Callable | None = None
    # ``tcp_seen()``: the tcp probe had events, so a connection is on a watched port
    # (kvtrace.fabric.tcpgate attaches tcp:tcp_probe then)
    tcp_seen: Callable | None = None

    def dev_name(self, dev: int) -> str:
        """Kernel dev_t (major<<20 | minor) to a disk name via /sys/dev/block, else the NVMe
        topology's (a hidden multipath path disk has a dev but no link there)."""
        name = self.dev_names.get(dev)
        if name is None:
            major, minor = dev >> 20, dev & ((1 << 20) - 1)
            try:
                import os

                name = os.path.basename(os.readlink(f"/sys/dev/block/{major}:{minor}"))
            except OSError:
                if dev and self.nvme_rescan is not None:   # a hidden multipath path disk: the topology names it
                    self.nvme_rescan(devs=[dev])
                name = self.dev_names.get(dev) or f"{major}:{minor}"
            self.dev_names[dev] = name
        return name


def map_items(table) -> list:
    """(key, value) pairs of a BPF map (a bcc table, or any object with items()), in one batch
    syscall where the kernel has it."""
    try:
        return list(table.items_lookup_batch())
    except Exception:
        return list(table.items())
