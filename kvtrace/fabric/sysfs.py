"""Small, never-raising readers of sysfs-like trees under a root (``/`` on a host, a recorded
tree in tests)."""
from __future__ import annotations

import os
from pathlib import Path


class Root:
    """Paths are given absolute (``/sys/class/nvme``) and read under ``root``."""

    def __init__(self, root: str | os.PathLike = "/"):
        self.root = Path(root)

    def path(self, p: str | os.PathLike) -> Path:
        p = str(p)
        return self.root / p.lstrip("/") if p.startswith("/") else self.root / p

    def read(self, p, default: str | None = None) -> str | None:
        """The file's text, stripped; ``default`` when it is missing or unreadable."""
        try:
            with open(self.path(p), "rb") as f:
                return f.read(65536).decode("utf-8", "replace").strip()
        except OSError:
            return default

    def read_int(self, p, default: int | None = None, base: int = 0) -> int | None:
        text = self.read(p)
        if text is None:
            return default
        try:
            return int(text.split()[0], base) if text else default
        except (ValueError, IndexError):
            return default

    def listdir(self, p) -> list[str]:
        try:
            return sorted(os.listdir(self.path(p)))
        except OSError:
            return []

    def exists(self, p) -> bool:
        return self.path(p).exists()

    def is_dir(self, p) -> bool:
        return self.path(p).is_dir()

    def realname(self, p) -> str | None:
        """The last component of the path the (symlinked) entry resolves to."""
        try:
            return os.path.basename(os.path.realpath(self.path(p)))
        except OSError:
            return None

    def relative(self, real: str) -> str:
        """A resolved path as seen from the root (``/sys/devices/...``)."""
        try:
            return "/" + os.path.relpath(real, self.root)
        except ValueError:
            return real


def parse_devt(text: str | None) -> tuple[int, int] | None:
    """'259:0' -> (259, 0)."""
    if not text or ":" not in text:
        return None
    a, _, b = text.partition(":")
    try:
        return int(a), int(b)
    except ValueError:
        return None


def kernel_dev(major: int, minor: int) -> int:
    """The dev_t as block tracepoints report it (MKDEV: major << 20 | minor)."""
    return (major << 20) | minor


def parse_cpulist(text: str | None) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; also the mq 'cpu_list' form '0, 1'."""
    out: list[int] = []
    if not text:
        return out
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if hi else a
        except ValueError:
            continue
        if 0 <= a <= b and b - a < 65536:
            out.extend(range(a, b + 1))
    return out
