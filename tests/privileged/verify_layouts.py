"""Compile kvtrace's whole program against another kernel's tracepoint layouts and load every
tracepoint program into this kernel's verifier (nothing is attached).

Run as root in a private mount namespace (the test does:
``unshare -m --propagation private python verify_layouts.py 6.1``): tracefs is mounted
again, the fixture format files of that kernel (tests/data/tpformats/<kernel>/events) are
laid over it, and the result is bind-mounted where bcc reads formats.  Prints JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMATS = HERE.parent / "data" / "tpformats"


def overlay(kernel: str) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvtrace-tp-"))
    real, fake = d / "real", d / "fake" / "events"
    real.mkdir()
    fake.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tracefs", "nodev", str(real)], check=True)
    for e in (real / "events").iterdir():
        os.symlink(e, fake / e.name)
    for system in (FORMATS / kernel / "events").iterdir():
        if (fake / system.name).is_symlink():
            (fake / system.name).unlink()
        shutil.copytree(system, fake / system.name)
    for target in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.isdir(target):
            subprocess.run(["mount", "--bind", str(fake.parent), target], check=True)


def main() -> None:
    kernel = sys.argv[1]
    overlay(kernel)
    sys.path.insert(0, str(HERE.parent.parent))
    from bcc import BPF
    from bcc.libbcc import lib

    from kvtrace.capture import program

    plan = program.plan(None)
    BPF._trace_autoload = lambda self: None   # verify only: these tracepoints do not exist here
    b = BPF(text=plan.text, cflags=plan.cflags)
    names = [lib.bpf_function_name(b.module, i).decode() for i in range(lib.bpf_num_functions(b.module))]
    verified = []
    for n in names:
        if n.startswith("tracepoint__"):
            b.load_func(n, BPF.TRACEPOINT)
            verified.append(n)
    maps = exercise_maps(b, plan) if "nvme" in plan.attached else {}
    print(json.dumps({"kernel": kernel, "attached": plan.attached, "skipped": plan.skipped,
                      "cflags": plan.cflags, "verified": verified, "maps": maps}))


def exercise_maps(b, plan) -> dict:
    """The user-space side against the real maps of the loaded program: settings written by
    session.configure, namespace entries written by the topology watcher (from the recorded
    nvme tree), and counts put in the maps read back by KernelMaps."""
    import ctypes
    import tempfile
    import types

    sys.path.insert(0, str(HERE.parent.parent))
    from kvtrace.capture.events import DecodeContext
    from kvtrace.attach import fabric as session
    from kvtrace.capture.kstats import KernelMaps
    from tests.sysfs_tree import materialize

    out = {}
    session.configure(b, plan, session.Options(nvme_event_rate=20000, nvme_slow_us=5000), ncpus=2)
    cfg = b["nvme_cfg"][ctypes.c_int(0)]
    out["cfg"] = [cfg.slow_ns, cfg.budget, cfg.mode]
    root = tempfile.mkdtemp()
    materialize("nvme.tree", root)
    ctx = DecodeContext()
    session.TopologyWatcher(ctx, {"nvme_ns": b["nvme_ns"], "nvme_qdepth": b["nvme_qdepth"]}, root=root)
    out["ns"] = sorted([k.ctrl_id, k.nsid, v.dev1, v.dev2, v.lba_shift] for k, v in b["nvme_ns"].items())
    out["qdepth"] = sorted([k.value, v.value] for k, v in b["nvme_qdepth"].items())
    q, h = b["nvme_qstats"], b["nvme_hist"]
    q[q.Key(ctrl_id=0, qid=2, opclass=0, pad=0)] = q.Leaf(setups=5, completions=4, bytes=16384, latency_ns=400000)
    h[h.Key(ctrl_id=0, qid=2, opclass=0, slot=17)] = ctypes.c_ulonglong(4)
    km = KernelMaps({n: b[n] for n in ("nvme_qstats", "nvme_hist", "nvme_drops")}, ctx, b["nvme_cfg"])
    tables = km.drain()
    out["queue"] = [[r["ctrl"], r["transport"], r["qid"], r["opclass"], r["completions"], r["bytes"], r["cpus"]]
                    for r in tables["nvme_queue"].to_pylist()]
    out["hist"] = [[r["slot"], r["count"]] for r in tables["nvme_queue_hist"].to_pylist()]
    out["epoch"] = b["nvme_cfg"][ctypes.c_int(0)].epoch
    if "tcp" in plan.attached:
        out["tcp_ports"] = sorted(k.value for k in b["tcp_ports"].keys())
    return out


if __name__ == "__main__":
    main()
