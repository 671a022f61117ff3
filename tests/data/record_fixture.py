"""Regenerate the recorded-event fixture (needs root): a known workload under kvtrace attach
with --raw-out.  The workload's own account of what it did is saved beside the raw file.

    sudo .venv/bin/python tests/data/record_fixture.py /dev/loop0
"""
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = r'''
import json, os, sys, time
from kvtrace.demo import io as workloads
from kvtrace.hook.transport import Transport
dev = sys.argv[1]
a = workloads.read_direct(dev, 65536, 4)
b = workloads.read_uring(dev, 65536, 4)
t = Transport(flag_path=sys.argv[2]); t.refresh()
t.emit("hook_start", time.monotonic_ns(), "fixture", "0.0", "fixture")
t.flush()
print(json.dumps({"direct": a, "uring": b, "hook_enabled": t.enabled}))
'''


def main(dev: str) -> None:
    raw = HERE / "events-6.18.raw"
    out = subprocess.run(
        [sys.executable, "-m", "kvtrace", "attach", "--quiet", "--out", "/tmp/kvtrace-fixture", "--raw-out", str(raw),
         "--", sys.executable, "-c", WORKLOAD, dev, "/dev/shm/kvtrace-agents"],
        check=True, capture_output=True, text=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[0])
    (HERE / "events-6.18.json").write_text(json.dumps(result, indent=1) + "\n")
    print(result)


if __name__ == "__main__":
    main(sys.argv[1])
