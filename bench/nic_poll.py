"""CPU cost of one NIC poll (kvtrace.fabric.counters.NicPoller): 4 mlx5 ports, about 217
counters, from the sysfs tree the unit test builds (tests/sysfs_tree.py: mlx5_four_ports), so
each counter is one pread of a small file.  sysfs reads of the real kernel cost about the same
per file (measured 1.4 us per pread of /sys/class/net/*/statistics/* on the 2-core VM).

Prints the ms of CPU per poll (the poller's own thread_time) and what that is of a core at
the default 100 ms interval; the unit test (tests/unit/test_nic_counters.py) checks what a
poll reads, this its cost.

    .venv/bin/python bench/nic_poll.py [--polls N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtrace.fabric import counters  # noqa: E402
from tests.sysfs_tree import mlx5_four_ports  # noqa: E402


def measure(polls: int, interval: float = 0.1) -> dict:
    with tempfile.TemporaryDirectory() as d:
        mlx5_four_ports(Path(d))
        p = counters.NicPoller(interval=interval, root=d)
        p.poll_once(full=True)
        ports = {(k[1], k[2]) for k in p.rdma.keys if k[2]}
        c0 = p.cpu_s
        for _ in range(polls):
            p.poll_once(full=False)
        per_poll = (p.cpu_s - c0) / polls
        n = len(p.rdma.keys)
        p.rdma.close()
    return {"ports": len(ports), "counters": n, "polls": polls,
            "ms_per_poll": round(per_poll * 1e3, 4), "core_pct_at_interval": round(per_poll / interval * 100, 3),
            "interval_s": interval}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--polls", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    r = measure(args.polls)
    print(f"{r['counters']} counters on {r['ports']} ports: {r['ms_per_poll']:.3f} ms CPU per poll = "
          f"{r['core_pct_at_interval']:.2f}% of a core at {r['interval_s'] * 1e3:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
