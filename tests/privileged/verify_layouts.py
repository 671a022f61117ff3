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
    print(json.dumps({"kernel": kernel, "attached": plan.attached, "skipped": plan.skipped,
                      "cflags": plan.cflags, "verified": verified}))


if __name__ == "__main__":
    main()
