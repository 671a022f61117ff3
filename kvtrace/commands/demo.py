"""`kvtrace demo`: the main job on an embedded default, end to end, with its own check.

``--io``: a loop device, a built-in workload that reads it with O_DIRECT and io_uring,
``kvtrace attach`` on it, the summary, and the workload's own account beside kvtrace's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from kvtrace.errors import CaptureError, PrivilegeError


def _sh(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise CaptureError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return p.stdout.strip()


def io_demo(out: Path, chunk: int = 131072, count: int = 64) -> int:
    from kvtrace.dataset.reader import Dataset

    with tempfile.TemporaryDirectory(prefix="kvtrace-demo-") as tmp:
        img = Path(tmp) / "kv.img"
        with open(img, "wb") as f:
            f.truncate(count * chunk)
        dev = _sh("losetup", "--find", "--show", "--direct-io=on", str(img))
        try:
            result = Path(tmp) / "workload.json"
            cmd = [sys.executable, "-m", "kvtrace", "attach", "--out", str(out), "--",
                   sys.executable, "-m", "kvtrace.workloads", "mixed", "--path", dev,
                   "--chunk", str(chunk), "--count", str(count), "--result", str(result)]
            if subprocess.run(cmd).returncode:
                raise CaptureError("kvtrace attach failed (see above)")
            truth = json.loads(result.read_text())
        finally:
            subprocess.run(["losetup", "-d", dev])
    ds = Dataset.open(out)
    disk = os.path.basename(dev)
    block = [r for r in ds.table("block_io").to_pylist() if r["disk"] == disk and r["pid"] == truth["pid"]]
    ring = [r for r in ds.table("io_uring").to_pylist() if r["op"] == "READ"]
    checks = [
        ("block requests", len(block), truth["calls"]),
        ("block bytes", sum(r["bytes"] for r in block), truth["bytes"]),
        ("io_uring reads", len(ring), truth["uring"]["calls"]),
        ("io_uring bytes", sum(r["bytes"] for r in ring), truth["uring"]["bytes"]),
    ]
    click.echo("\nkvtrace demo: what kvtrace recorded vs what the workload did")
    ok = True
    for name, got, want in checks:
        ok &= got == want
        click.echo(f"  {name:16} kvtrace {got:>12,}   workload {want:>12,}   {'ok' if got == want else 'MISMATCH'}")
    return 0 if ok else 1


@click.command("demo")
@click.option("--io", "io_only", is_flag=True, help="Run the built-in I/O workload demo.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Where to keep the dataset (default: a new temp dir).")
def command(io_only: bool, out: str | None) -> int:
    """Run the main job on an embedded default and print its report."""
    if os.geteuid() != 0:
        raise PrivilegeError("the demo attaches BPF probes and makes a loop device: run it with sudo")
    out_dir = Path(out or tempfile.mkdtemp(prefix="kvtrace-demo-ds-"))
    rc = io_demo(out_dir)
    click.echo(f"dataset: {out_dir} (read it again with: kvtrace summary {out_dir})")
    return rc
