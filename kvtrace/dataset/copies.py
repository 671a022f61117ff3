"""One run under several ``host=`` partitions (a dataset copied or merged twice): read once.

A run id (UTC start time and a random suffix) is made by one `kvtrace attach` on one host, so the
same id under two host partitions is one run copied, and counting both would count every figure
twice (or, where a figure deduplicates, once: the two would disagree).  The run is read from the
partition whose files hold the most rows (on a tie, the first host name in sort order); the
others' files of that run are left out, said in one warning line (docs/schema.md).
"""
from __future__ import annotations

import re
from pathlib import Path

PART = re.compile(r"-p\d{6}$")


def run_of(path: Path) -> str:
    """The run a file belongs to: its name, without a part file's ``-pNNNNNN``."""
    return PART.sub("", path.stem)


def host_of(path: Path, root: Path) -> str | None:
    return next((p.split("=", 1)[1] for p in path.relative_to(root).parts if p.startswith("host=")), None)


def duplicates(root: Path, footers: dict[str, dict]) -> dict[str, tuple[str, dict[str, int]]]:
    """run -> (the host kept, rows per host) for every run found under several hosts."""
    rows: dict[str, dict[str, int]] = {}
    for files in footers.values():
        for p, f in files.items():
            host = host_of(p, root)
            if host is not None:
                per = rows.setdefault(run_of(p), {})
                per[host] = per.get(host, 0) + f.rows
    return {run: (sorted(per, key=lambda h: (-per[h], h))[0], per) for run, per in rows.items() if len(per) > 1}


def drop_copies(root: Path, footers: dict[str, dict]) -> list[str]:
    """Leave out the files of every run's other host partitions; the warning lines."""
    lines = []
    for run, (keep, per) in sorted(duplicates(root, footers).items()):
        for files in footers.values():
            for p in [p for p in files if run_of(p) == run and host_of(p, root) not in (None, keep)]:
                del files[p]
        others = sorted(h for h in per if h != keep)
        lines.append(f"run {run} is under {len(per)} host partitions (host={keep} and host={', host='.join(others)}: "
                     f"a copy?); it is read once, from host={keep} ({per[keep]:,} rows), and the files under "
                     f"host={', host='.join(others)} are left out")
    return lines
