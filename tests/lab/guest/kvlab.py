#!/usr/bin/python3
"""The storage lab's guest side (standard library only; runs on the guest's /usr/bin/python3).

    kvlab.py write --dir D --ns NAME --blocks N --block-size S --manifest M.json
        write N KV-block files (one file per block, as a KV connector stores them) and the
        sha256 of each to a manifest kept off the device
    kvlab.py run --config C.json --result R.json
        the traced part: connect the NVMe-oF controllers (so the connections start under the
        trace), mount every namespace read-only, then read its blocks like a KV connector
        does (whole block per call, O_DIRECT and buffered), recording the kernel's own
        accounting (/sys/block/*/stat, RDMA counters, TCP socket state) before and after every
        phase and over the whole run

Every figure the host checks the dataset against comes from here.  Clock: CLOCK_MONOTONIC,
the clock of kvtrace's timestamps.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

STAT_FIELDS = ("reads", "read_merges", "read_sectors", "read_ticks", "writes", "write_merges",
               "write_sectors", "write_ticks", "in_flight", "io_ticks", "queue_ticks")
NS_RE = re.compile(r"^nvme(\d+)(?:c(\d+))?n(\d+)$")


def now() -> int:
    return time.monotonic_ns()


def read_text(p: str | Path, default: str = "") -> str:
    try:
        return Path(p).read_text().strip()
    except OSError:
        return default


def disk_stat(disk: str) -> dict | None:
    f = read_text(f"/sys/block/{disk}/stat").split()
    if not f:
        return None
    return {k: int(v) for k, v in zip(STAT_FIELDS, f)}


def rdma_counters() -> dict:
    """Every numeric file under /sys/class/infiniband/*/ports/*/{counters,hw_counters}."""
    out = {}
    for dev in sorted(Path("/sys/class/infiniband").glob("*")):
        for port in sorted((dev / "ports").glob("*")):
            for group in ("counters", "hw_counters"):
                for f in sorted((port / group).glob("*")):
                    v = read_text(f)
                    if v.lstrip("-").isdigit():
                        out[f"{dev.name}/{port.name}/{group}/{f.name}"] = int(v)
    return out


def tcp_sockets(port: int) -> list[dict]:
    """`ss -ti` for the established connections on an NVMe/TCP port, parsed."""
    p = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} or dport = :{port} )"],
                       capture_output=True, text=True)
    socks, cur = [], None
    for line in p.stdout.splitlines():
        if not line.startswith((" ", "\t")):
            f = line.split()
            if len(f) >= 4:
                cur = {"local": f[-2], "peer": f[-1]}
                socks.append(cur)
            continue
        if cur is None:
            continue
        for tok in line.split():
            if ":" not in tok:
                continue
            k, v = tok.split(":", 1)
            if k == "rtt" and "/" in v:
                cur["rtt_ms"], cur["rttvar_ms"] = (float(x) for x in v.split("/"))
            elif k == "retrans" and "/" in v:
                cur["retrans_now"], cur["retrans_total"] = (int(x) for x in v.split("/"))
            elif k in ("minrtt", "rto"):
                cur[k] = float(v)
            elif k in ("bytes_sent", "bytes_retrans", "bytes_acked", "bytes_received", "segs_out", "segs_in",
                       "data_segs_out", "data_segs_in", "lost", "reordering"):
                try:
                    cur[k] = int(v)
                except ValueError:
                    pass
        cur.setdefault("retrans_total", 0)
    return socks


def controllers() -> dict:
    out = {}
    for c in sorted(Path("/sys/class/nvme").glob("nvme*")):
        out[c.name] = {
            "transport": read_text(c / "transport"), "address": read_text(c / "address"),
            "subsysnqn": read_text(c / "subsysnqn"), "state": read_text(c / "state"),
            "queue_count": int(read_text(c / "queue_count", "0") or 0), "serial": read_text(c / "serial"),
            "namespaces": sorted(p.name for p in c.iterdir() if NS_RE.match(p.name)),
        }
    return out


def parse_address(text: str) -> dict:
    return dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)


def namespace_disks(ctrl: str) -> tuple[str, str]:
    """(head, path) block devices of the controller's namespace 1: the same name twice without
    native multipath; nvmeSnN and its per-controller path nvmeScCnN with it."""
    for name in controllers()[ctrl]["namespaces"]:
        m = NS_RE.match(name)
        if m and m.group(3) == "1":
            return (f"nvme{m.group(1)}n{m.group(3)}" if m.group(2) else name), name
    raise RuntimeError(f"{ctrl} has no namespace 1")


def ctrl_for(nqn: str) -> str | None:
    for name, c in controllers().items():
        if c["subsysnqn"] == nqn and c["state"] == "live":
            return name
    return None


def sh(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def connect(ns: dict) -> dict:
    t0 = now()
    sh("nvme", "connect", "-t", ns["transport"], "-a", ns["traddr"], "-s", str(ns["trsvcid"]), "-n", ns["nqn"],
       "--keep-alive-tmo", str(ns.get("kato", 3600)), "--nr-io-queues", str(ns.get("io_queues", 2)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ctrl = ctrl_for(ns["nqn"])
        if ctrl:
            try:
                head, path = namespace_disks(ctrl)
                if Path(f"/dev/{head}").exists() and Path(f"/sys/block/{path}/stat").exists():
                    return {"ctrl": ctrl, "head": head, "path": path, "connect_start_ns": t0, "connect_end_ns": now()}
            except RuntimeError:
                pass
        time.sleep(0.2)
    raise RuntimeError(f"no live controller with a namespace for {ns['nqn']} 60 s after nvme connect")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def expected_block(ns: str, i: int, size: int) -> bytes:
    return random.Random(f"kvtrace-lab/{ns}/{i}").randbytes(size)


def read_blocks(mount: str, mode: str, digests: dict) -> dict:
    """Read every block file whole, one call per block (as a KV connector loads a block)."""
    names = sorted(n for n in os.listdir(mount) if n.endswith(".kv"))
    calls = nbytes = 0
    bad = []
    size = max((os.stat(os.path.join(mount, n)).st_size for n in names), default=0)
    buf = mmap.mmap(-1, max(size, mmap.PAGESIZE))  # page aligned, as O_DIRECT needs
    for name in names:
        p = os.path.join(mount, name)
        if mode == "direct":
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                n = os.preadv(fd, [memoryview(buf)[:size]], 0)
                calls += 1
                data = buf[:n]
            finally:
                os.close(fd)
        else:
            fd = os.open(p, os.O_RDONLY)
            try:
                parts, got = [], 0
                while got < size:
                    b = os.read(fd, size - got)
                    calls += 1
                    if not b:
                        break
                    parts.append(b)
                    got += len(b)
                data = b"".join(parts)
            finally:
                os.close(fd)
        nbytes += len(data)
        if hashlib.sha256(data).hexdigest() != digests.get(name):
            bad.append(name)
    buf.close()
    return {"files": len(names), "calls": calls, "bytes": nbytes, "block_size": size, "corrupt": bad}


def cmd_write(a) -> None:
    d = Path(a.dir)
    digests = {}
    for i in range(a.blocks):
        name = f"block-{i:05d}.kv"
        data = expected_block(a.ns, i, a.block_size)
        with open(d / name, "wb") as f:
            f.write(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    os.sync()
    Path(a.manifest).write_text(json.dumps(digests))


def snapshot(nss: dict) -> dict:
    return {"ts_ns": now(), "stat": {d: disk_stat(d) for ns in nss.values() for d in {ns["head"], ns["path"]}}}


def cmd_run(a) -> None:
    cfg = json.loads(Path(a.config).read_text())
    res = {"pid": os.getpid(), "tid": threading.get_native_id(), "start_ns": now(), "phases": [], "namespaces": {}}
    res["rdma_start"] = rdma_counters()
    nss = {}
    # 1. the PCIe namespace is there from boot; the fabrics ones are connected now, traced
    for name, ns in cfg["namespaces"].items():
        if ns["transport"] == "pcie":
            head, path = namespace_disks(ns["ctrl"])
            nss[name] = {"ctrl": ns["ctrl"], "head": head, "path": path}
    start = snapshot(nss)  # before any I/O of the run on the PCIe namespace
    for name, ns in cfg["namespaces"].items():
        if ns["transport"] != "pcie":
            nss[name] = connect(ns)
    # a fabrics namespace appeared during the run: its counters started at zero
    for name, ns in nss.items():
        for d in {ns["head"], ns["path"]}:
            start["stat"].setdefault(d, {k: 0 for k in STAT_FIELDS})
    res["start"] = start
    ctrls = controllers()
    for name, ns in nss.items():
        c = ctrls[ns["ctrl"]]
        ns.update(transport=c["transport"], address=c["address"], subsysnqn=c["subsysnqn"],
                  queue_count=c["queue_count"], ctrl_id=int(ns["ctrl"][4:]), **parse_address(c["address"]),
                  lba_bytes=int(read_text(f"/sys/block/{ns['path']}/queue/logical_block_size")))
        ns["mount"] = f"/lab/mnt/{name}"
        os.makedirs(ns["mount"], exist_ok=True)
        sh("mount", "-o", "ro,noatime", f"/dev/{ns['head']}", ns["mount"])
    # 2. the reads, one phase per namespace and mode
    cpus = sorted(os.sched_getaffinity(0))
    for name, ns in nss.items():
        digests = json.loads(Path(cfg["namespaces"][name]["manifest"]).read_text())
        for i, mode in enumerate(cfg.get("modes", ["direct", "buffered"])):
            # one CPU per mode: blk-mq maps each CPU to its own hardware queue, so every
            # NVMe I/O queue carries a phase of its own
            cpu = cpus[i % len(cpus)]
            os.sched_setaffinity(0, {cpu})
            drop_caches()
            disks = sorted({ns["head"], ns["path"]})
            before = {d: disk_stat(d) for d in disks}
            rb = rdma_counters() if ns["transport"] == "rdma" else None
            t0 = now()
            r = read_blocks(ns["mount"], mode, digests)
            t1 = now()
            ph = {"ns": name, "mode": mode, "cpu": cpu, "t0": t0, "t1": t1, **r,
                  "stat_before": before, "stat_after": {d: disk_stat(d) for d in disks}}
            if rb is not None:
                ph["rdma_before"], ph["rdma_after"] = rb, rdma_counters()
            res["phases"].append(ph)
            print(f"LAB-PHASE {name} {mode}: {r['files']} files, {r['bytes']} bytes, {r['calls']} calls, "
                  f"{(t1 - t0) / 1e6:.0f} ms{', CORRUPT ' + str(r['corrupt']) if r['corrupt'] else ''}", flush=True)
    os.sched_setaffinity(0, cpus)
    # 3. the end of the run: nothing of the lab does I/O after this
    res["tcp_sockets"] = {str(ns["trsvcid"]): tcp_sockets(int(ns["trsvcid"])) for ns in nss.values()
                          if ns["transport"] == "tcp"}
    res["end"] = snapshot(nss)
    res["rdma_end"] = rdma_counters()
    res["namespaces"] = nss
    res["controllers"] = controllers()
    res["end_ns"] = now()
    Path(a.result).write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--dir", required=True)
    w.add_argument("--ns", required=True)
    w.add_argument("--blocks", type=int, default=64)
    w.add_argument("--block-size", type=int, default=256 * 1024)
    w.add_argument("--manifest", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", required=True)
    r.add_argument("--result", required=True)
    a = ap.parse_args()
    try:
        {"write": cmd_write, "run": cmd_run}[a.cmd](a)
    except Exception as e:  # one line, the step is named by the caller
        print(f"kvlab {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
