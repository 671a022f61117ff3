"""The storage lab: a real NVMe-oF stack (Debian's 6.1 kernel under QEMU) traced by kvtrace,
checked against the kernel's own accounting.

The guest (tests/lab/guest/main.sh) exports two null_blk disks with nvmet, one over TCP and
one over RDMA through soft-RoCE (rxe), next to QEMU's emulated PCIe NVMe drive.  kvtrace
attach runs in the guest on tests/lab/guest/kvlab.py, which connects both fabrics (so the
connections start under the trace), mounts the three ext4 filesystems and reads their
KV-block files, one file per block, O_DIRECT and buffered, recording /sys/block/*/stat,
the RDMA counters and the TCP sockets around each phase.  A trace instance records the same
NVMe, RDMA CM and TCP tracepoints through ftrace.  Here the dataset is compared with all
that.

Runs build.sh (cached image) and run.sh once per session; KVTRACE_LAB_RESULTS=DIR checks
an earlier run's results instead.  A check whose table of the schema is not in the dataset
fails, naming the table.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtrace.capture import nvme
from kvtrace.dataset import schema

pytestmark = pytest.mark.root
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KVTRACE_LAB_CACHE", "/var/cache/kvtrace/lab"))
NAMESPACES = ("pcie", "tcp", "rdma")
PHASES = [(ns, mode) for ns in NAMESPACES for mode in ("direct", "buffered")]


def _skip_reason() -> str | None:
    if os.environ.get("KVTRACE_LAB_RESULTS"):
        return None
    if os.environ.get("KVTRACE_LAB_SKIP"):
        return "KVTRACE_LAB_SKIP is set"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"the lab boots an x86_64 Debian guest with QEMU on Linux; this is {platform.system()} {platform.machine()}"
    if os.geteuid() != 0:
        return "the lab needs root (debootstrap, QEMU's 9p shares)"
    if not (shutil.which("qemu-system-x86_64") and shutil.which("debootstrap")) and not shutil.which("apt-get"):
        return "no qemu-system-x86_64/debootstrap and no apt-get to install them"
    return None


# ----------------------------------------------------------------------------- the run


@dataclass
class Lab:
    out: Path
    reader: dict
    ds: object
    ftrace: list[dict]
    timings: dict
    tables: dict = field(default_factory=dict)

    def table(self, name: str) -> list[dict]:
        if name not in self.tables:
            if name not in schema.TABLES:
                pytest.fail(f"{name!r} is no table of the dataset schema (kvtrace/dataset/schema.py): a bug in this test")
            if name not in self.ds.names():
                pytest.fail(f"the dataset has no {name} table: kvtrace did not write it")
            self.tables[name] = self.ds.table(name).to_pylist()
        return self.tables[name]

    def ns(self, name: str) -> dict:
        return self.reader["namespaces"][name]

    def phase(self, ns: str, mode: str) -> dict:
        (ph,) = [p for p in self.reader["phases"] if p["ns"] == ns and p["mode"] == mode]
        return ph


def _script(cmd: list[str], timeout: int, env: dict | None = None) -> tuple[int, str]:
    """Run a lab script; on timeout stop it with SIGTERM (so it stops its QEMU), then SIGKILL."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        err += f"\nno end within {timeout}s"
    return p.returncode, err


def _run(cmd: list[str], what: str, timeout: int) -> float:
    t0 = time.monotonic()
    rc, err = _script(cmd, timeout)
    if rc != 0:
        lines = [line for line in err.splitlines() if "FAILED" in line] or err.splitlines()[-3:]
        pytest.fail(f"lab {what}: " + " | ".join(lines))
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def image() -> float:
    """Build the guest image (or find it current in the cache); the seconds it took."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if os.environ.get("KVTRACE_LAB_RESULTS"):
        return 0.0
    if sys.prefix != sys.base_prefix:  # the guest runs kvtrace from the venv running these tests
        os.environ.setdefault("KVTRACE_VENV", sys.prefix)
    return round(_run([str(HERE / "build.sh")], "build (tests/lab/build.sh)", 1800), 1)


@pytest.fixture(scope="module")
def lab(image) -> Lab:
    from kvtrace.dataset.reader import Dataset

    given = os.environ.get("KVTRACE_LAB_RESULTS")
    timings = {}
    if given:
        out = Path(given)
    else:
        out = CACHE / "last-run"
        shutil.rmtree(out, ignore_errors=True)
        timings["build_s"] = image
        _run([str(HERE / "run.sh"), "--out", str(out)], "run (tests/lab/run.sh)", 2400)
    timings.update(json.loads((out / "timings.json").read_text()))
    if not given:
        (out / "timings.json").write_text(json.dumps(timings))
    if not (out / "reader.json").exists():
        err = (out / "attach.stderr").read_text().splitlines()[-1:] if (out / "attach.stderr").exists() else []
        pytest.fail(f"the reader wrote no result in the guest (kvtrace attach: {err})")
    return Lab(out=out, reader=json.loads((out / "reader.json").read_text()), ds=Dataset.open(out / "ds"),
               ftrace=parse_ftrace((out / "ftrace.txt").read_text()), timings=timings)


# ----------------------------------------------------------------------------- ftrace text

FTRACE_LINE = re.compile(r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+\[\d+\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+(?P<event>\w+):\s+(?P<body>.*)$")
NVME_SETUP = re.compile(r"nvme(?P<ctrl>\d+): (?:disk=(?P<disk>\S+), )?qid=(?P<qid>\d+), cmdid=(?P<cid>\d+), nsid=(?P<nsid>\d+), .*cmd=\((?P<op>\S+)(?P<args>.*)\)$")
NVME_DONE = re.compile(r"nvme(?P<ctrl>\d+): (?:disk=(?P<disk>\S+), )?qid=(?P<qid>\d+), cmdid=(?P<cid>\d+), res=\S+, retries=(?P<retries>\d+), flags=\S+, status=(?P<status>\S+)$")
CM_EVENT = re.compile(r"cm\.id=(?P<id>\d+) src=(?P<src>\S+) dst=(?P<dst>\S+) tos=\d+ (?P<cm_event>\S+) \((?:\d+/)?(?P<status>-?\d+)\)")
TCP_RETRANS = re.compile(r"sport=(?P<sport>\d+) dport=(?P<dport>\d+) saddr=(?P<saddr>\S+) daddr=(?P<daddr>\S+)")


def parse_ftrace(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        m = FTRACE_LINE.match(line)
        if not m:
            continue
        ev, body = m["event"], m["body"]
        rec = {"event": ev, "ts_ns": round(float(m["ts"]) * 1e9), "pid": int(m["pid"])}
        if ev in ("nvme_setup_cmd", "nvme_complete_rq"):
            f = (NVME_SETUP if ev == "nvme_setup_cmd" else NVME_DONE).match(body)
            assert f, line
            rec.update({k: v for k, v in f.groupdict().items() if v is not None})
            rec["ctrl"], rec["qid"] = f"nvme{rec['ctrl']}", int(rec["qid"])
            if ev == "nvme_setup_cmd":
                args = rec.pop("args")
                length, slba = re.search(r"\blen=(\d+)", args), re.search(r"\bslba=(\d+)", args)
                rec["nlb"] = int(length.group(1)) + 1 if length else 0
                if slba:
                    rec["slba"] = int(slba.group(1))
        elif ev == "cm_event_handler":
            f = CM_EVENT.search(body)
            assert f, line
            rec.update(f.groupdict())
        elif ev == "tcp_retransmit_skb":
            f = TCP_RETRANS.search(body)
            assert f, line
            rec.update(f.groupdict())
        out.append(rec)
    return out


def stat_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in ("reads", "read_sectors", "writes", "write_sectors")}


# ----------------------------------------------------------------------------- the run itself


def test_lab_ran_every_step(lab):
    """The guest finished; the ftrace buffer lost nothing; the reader read back what was written."""
    assert (lab.out / "ok").exists()
    overrun = re.findall(r"overrun: (\d+)", (lab.out / "ftrace.overrun").read_text())
    assert overrun and set(overrun) == {"0"}, overrun
    for ph in lab.reader["phases"]:
        assert ph["corrupt"] == [] and ph["files"] == 64 and ph["bytes"] == 64 * ph["block_size"], ph["ns"]
    assert {ph["ns"] for ph in lab.reader["phases"]} == set(NAMESPACES)
    print(f"lab timings: {json.dumps(lab.timings)}")


def test_attach_exited_cleanly(lab):
    rc = int((lab.out / "attach.rc").read_text())
    err = [line for line in (lab.out / "attach.stderr").read_text().splitlines() if line and not line.startswith(" ")]
    assert rc == 0, f"kvtrace attach exited {rc} in the guest: {err[-1] if err else ''}"


def test_dataset_is_complete(lab):
    (run,) = lab.ds.runs()
    assert run["status"] == "complete", run["status"]
    assert not any(run["lost_events"].values()) and run["dropped_events"] == 0, run["lost_events"]
    assert lab.ds.problems == []


# ----------------------------------------------------------------------------- block and file level


@pytest.mark.parametrize("ns,mode", PHASES)
def test_block_io_equals_disk_stat(lab, ns, mode):
    """Per namespace and phase: block_io's requests and bytes for the reader equal the delta of
    the namespace's /sys/block/*/stat (the per-controller path for a multipath namespace)."""
    n, ph = lab.ns(ns), lab.phase(ns, mode)
    d = stat_delta(ph["stat_before"][n["path"]], ph["stat_after"][n["path"]])
    assert d["reads"] >= 64 and d["writes"] == 0
    rows = [r for r in lab.table("block_io")
            if r["disk"] in (n["head"], n["path"]) and ph["t0"] <= r["start_ns"] <= ph["t1"]]
    assert all(r["pid"] == lab.reader["pid"] and r["op"] == "R" for r in rows)
    assert all((r.get("weight") or 1) == 1 for r in rows)  # nothing sampled at this rate
    assert len(rows) == d["reads"], (len(rows), d)
    # a completion the kernel did not run the probe for (it interrupted another BPF program on
    # that CPU) is settled at the stop: a row without latency or error (kvtrace.capture.settle)
    assert all(r["latency_ns"] > 0 if r["latency_ns"] is not None else r["error"] is None and r["issue_ns"] > 0
               for r in rows)
    assert sum(r["bytes"] for r in rows) == d["read_sectors"] * 512
    # each request's bytes are the whole request's: those of the NVMe command the kernel built for it
    cmds = {c.get("slba"): c["nlb"] * n["lba_bytes"] for c in lab.ftrace if c["event"] == "nvme_setup_cmd"
            and c["ctrl"] == n["ctrl"] and c["qid"] > 0 and ph["t0"] <= c["ts_ns"] <= ph["t1"]}
    assert all(r["bytes"] == cmds.get(r["sector"] * 512 // n["lba_bytes"], r["bytes"]) for r in rows)


@pytest.mark.parametrize("ns,mode", PHASES)
def test_file_io_equals_the_reader(lab, ns, mode):
    """Per phase: one read call per KV block, exactly the reader's calls and bytes."""
    n, ph = lab.ns(ns), lab.phase(ns, mode)
    rows = [r for r in lab.table("file_io")
            if r["path"].startswith(n["mount"] + "/") and r["syscall"] in ("read", "pread64", "readv", "preadv", "preadv2")]
    rows = [r for r in rows if ph["t0"] <= r["start_ns"] <= ph["t1"]]
    assert len(rows) == ph["calls"] == 64
    assert sum(r["bytes"] for r in rows) == ph["bytes"]
    assert all(r["tid"] == lab.reader["tid"] and r["bytes"] == ph["block_size"] for r in rows)
    assert {r["syscall"] for r in rows} <= ({"preadv", "preadv2"} if mode == "direct" else {"read"})


# ----------------------------------------------------------------------------- NVMe


def _queues(lab, ctrl: str) -> dict:
    """nvme_queue summed over the run: (qid, opclass) -> counters."""
    agg: dict = defaultdict(Counter)
    for r in lab.table("nvme_queue"):
        if r["ctrl"] == ctrl:
            agg[(r["qid"], r["opclass"])].update({k: r.get(k) or 0 for k in ("setups", "completions", "bytes", "errors",
                                                                              "unmatched", "unseen")})
    return agg


@pytest.mark.parametrize("ns", NAMESPACES)
def test_nvme_queue_counts_equal_ftrace(lab, ns):
    """Per controller and queue: kvtrace's setups and completions equal the nvme_setup_cmd and
    nvme_complete_rq records the kernel wrote to its own trace buffer over the run."""
    ctrl = lab.ns(ns)["ctrl"]
    q = _queues(lab, ctrl)
    ours = Counter()
    done = Counter()
    for (qid, _), c in q.items():
        ours[qid] += c["setups"]
        done[qid] += c["completions"]
    kernel = Counter(r["qid"] for r in lab.ftrace if r["event"] == "nvme_setup_cmd" and r["ctrl"] == ctrl)
    kdone = Counter(r["qid"] for r in lab.ftrace if r["event"] == "nvme_complete_rq" and r["ctrl"] == ctrl)
    assert {k: v for k, v in ours.items() if v} == dict(kernel)
    assert {k: v for k, v in done.items() if v} == dict(kdone)
    assert len([qid for qid in kernel if qid > 0]) == lab.ns(ns)["queue_count"] - 1  # every I/O queue used


@pytest.mark.parametrize("ns", NAMESPACES)
def test_nvme_reads_equal_disk_stat(lab, ns):
    """Over the run: read commands on the I/O queues and their bytes equal the delta of the
    namespace's /sys/block stat (a fabrics namespace appeared in the run: from zero)."""
    n = lab.ns(ns)
    d = stat_delta(lab.reader["start"]["stat"][n["path"]], lab.reader["end"]["stat"][n["path"]])
    q = _queues(lab, n["ctrl"])
    reads = sum(c["setups"] for (qid, op), c in q.items() if qid > 0 and op == "read")
    writes = sum(c["setups"] for (qid, op), c in q.items() if qid > 0 and op == "write")
    assert reads == d["reads"] and writes == d["writes"] == 0
    kernel_bytes = sum(r["nlb"] * n["lba_bytes"] for r in lab.ftrace
                       if r["event"] == "nvme_setup_cmd" and r["ctrl"] == n["ctrl"] and r["qid"] > 0)
    assert kernel_bytes == d["read_sectors"] * 512
    got = sum(c["bytes"] for (qid, op), c in q.items() if qid > 0 and op == "read")
    assert got == kernel_bytes
    rows = [r for r in lab.table("nvme_cmd") if r["ctrl"] == n["ctrl"] and r["qid"] > 0]
    assert sum(r["bytes"] for r in rows) == kernel_bytes
    assert all(r["bytes"] == r["nlb"] * n["lba_bytes"] for r in rows)


@pytest.mark.parametrize("ns,mode", PHASES)
def test_nvme_phase_on_its_queue_equals_disk_stat(lab, ns, mode):
    """Per phase (the reader pinned to one CPU, so to one I/O queue): kvtrace's read commands
    are all on that CPU's queue (as kvtrace's own nvme_hctx maps it), and their count and bytes
    equal the phase's /sys/block stat delta."""
    n, ph = lab.ns(ns), lab.phase(ns, mode)
    d = stat_delta(ph["stat_before"][n["path"]], ph["stat_after"][n["path"]])
    hctx = [r for r in lab.table("nvme_hctx") if r["ctrl"] == n["ctrl"] and ph["cpu"] in r["cpus"]]
    assert {r["qid"] for r in hctx} and len({r["qid"] for r in hctx}) == 1
    rows = [r for r in lab.table("nvme_cmd") if r["ctrl"] == n["ctrl"] and r["qid"] > 0
            and ph["t0"] <= r["setup_ns"] <= ph["t1"]]
    assert {r["qid"] for r in rows} == {hctx[0]["qid"]}
    assert len(rows) == d["reads"] and all(r["opclass"] == "read" and r["weight"] == 1 for r in rows)
    assert sum(r["bytes"] for r in rows) == d["read_sectors"] * 512


@pytest.mark.parametrize("ns", NAMESPACES)
def test_nvme_commands_matched_setup_to_complete(lab, ns):
    """Every command set up was completed and matched: no unmatched, no errors; each per-command
    row (--nvme-events all) has a latency and success, and rows per queue equal the counts.
    A completion the kernel did not run the probe for (it interrupted another BPF program on
    that CPU) is a row without latency or status, counted in `unseen`; the rows' command ids
    are exactly the completions in the kernel's own trace."""
    n = lab.ns(ns)
    q = _queues(lab, n["ctrl"])
    assert q, f"no nvme_queue rows for {n['ctrl']}"
    for key, c in q.items():
        assert c["setups"] == c["completions"] and c["unmatched"] == 0 and c["errors"] == 0, (key, c)
    rows = [r for r in lab.table("nvme_cmd") if r["ctrl"] == n["ctrl"] and r["qid"] > 0]
    per_q = Counter(r["qid"] for r in rows)
    assert per_q == Counter({qid: c["setups"] for (qid, op), c in q.items() if qid > 0 and c["setups"]})
    seen = [r for r in rows if r["latency_ns"] is not None]
    unseen = [r for r in rows if r["latency_ns"] is None]
    assert all(r["latency_ns"] > 0 and r["status_text"] == "success" and r["disk"] == n["path"] for r in seen)
    assert all(r["status"] is None and r["status_text"] == nvme.UNSEEN_TEXT and r["disk"] == n["path"] for r in unseen)
    assert Counter(r["qid"] for r in unseen) == Counter({qid: c["unseen"] for (qid, op), c in q.items() if c["unseen"]})
    kernel = Counter((r["qid"], int(r["cid"])) for r in lab.ftrace if r["event"] == "nvme_complete_rq" and r["ctrl"] == n["ctrl"] and r["qid"] > 0)
    assert Counter((r["qid"], r["cid"]) for r in rows) == kernel


@pytest.mark.parametrize("ns", NAMESPACES)
def test_topology_transport_and_target(lab, ns):
    """nvme_ctrl/nvme_ns say the transport and target address sysfs says, and map the disk."""
    n = lab.ns(ns)
    ctrls = [r for r in lab.table("nvme_ctrl") if r["ctrl"] == n["ctrl"]]
    assert ctrls, f"no nvme_ctrl row for {n['ctrl']}"
    c = ctrls[-1]
    assert c["transport"] == n["transport"] == ns
    assert c["subsysnqn"] == n["subsysnqn"] and c["address"] == n["address"]
    if ns == "pcie":
        assert c["target"] == n["address"]
    else:
        assert (c["traddr"], c["trsvcid"]) == (n["traddr"], n["trsvcid"]) == ("10.77.0.1", {"tcp": "4420", "rdma": "4421"}[ns])
        assert c["target"] == f"{n['traddr']}:{n['trsvcid']}"
    nss = [r for r in lab.table("nvme_ns") if r["ctrl"] == n["ctrl"]]
    assert nss and nss[-1]["disk"] == n["path"] and nss[-1]["head"] == n["head"]
    assert nss[-1]["multipath"] == (n["head"] != n["path"]) and nss[-1]["lba_bytes"] == n["lba_bytes"]
    cmds = {(r["transport"], r["traddr"]) for r in lab.table("nvme_cmd") if r["ctrl"] == n["ctrl"]}
    assert cmds == {(ns, c["target"])}


# ----------------------------------------------------------------------------- RDMA


def test_rxe_counter_deltas_equal_direct_reads(lab):
    """The rxe device's hw_counters: kvtrace's deltas over the run equal a direct before/after
    read of sysfs (nothing but the lab's NVMe/RDMA moves them, keep-alive at 1 h)."""
    rows = [r for r in lab.table("nic_counters") if r["device"] == "rxe0"]
    assert rows, "no rxe0 counters"
    ours = Counter()
    for r in rows:
        ours[(r["source"], r["name"])] += r["delta"] or 0
        assert r["status"] in ("first", "ok"), r
    start, end = lab.reader["rdma_start"], lab.reader["rdma_end"]
    direct = {}
    for k, v in end.items():
        dev, port, group, name = k.split("/")
        if dev == "rxe0":
            direct[name] = v - start.get(k, 0)
    assert direct["sent_pkts"] > 1000 and direct["rcvd_pkts"] > 1000
    mine = {name: v for (src, name), v in ours.items() if src.endswith("hw_counters")}
    assert {k: v for k, v in mine.items() if k in direct} == {k: v for k, v in direct.items() if k in mine}
    assert {"sent_pkts", "rcvd_pkts", "rdma_sends", "rdma_recvs"} <= set(mine)


def test_rdma_cm_events_at_connect(lab):
    """Every rdma_cma event the kernel traced is in rdma_events, at connect: one established
    connection per NVMe/RDMA queue (admin + I/O), on the target's port."""
    n = lab.ns("rdma")
    ev = [r for r in lab.table("rdma_events") if r["event"] == "cm_event_handler"]
    kernel = [r for r in lab.ftrace if r["event"] == "cm_event_handler"]
    assert kernel
    assert Counter((r["cm_event"], r["src"], r["dst"], r["status"]) for r in ev) == \
        Counter((k["cm_event"], k["src"], k["dst"], int(k["status"])) for k in kernel)
    est = [r for r in ev if r["cm_event"] == "ESTABLISHED" and r["dst"].endswith(":4421")]
    assert len(est) == n["queue_count"]
    assert all(n["connect_start_ns"] <= r["ts_ns"] <= n["connect_end_ns"] for r in est)


# ----------------------------------------------------------------------------- NVMe/TCP


def _conn(saddr, sport, daddr, dport) -> str:
    return f"{saddr}:{sport}->{daddr}:{dport}"


def test_tcp_retransmits_equal_ftrace(lab):
    """NVMe/TCP retransmissions (netem drops 1% on lo): kvtrace's are the kernel's
    tcp_retransmit_skb records, connection by connection, and the sockets' own count.

    A retransmission often runs in a softirq; when that softirq interrupts another BPF program
    on its CPU (one of kvtrace's own syscall programs), the kernel does not run the
    tracepoint's program, and before Linux 6.7 it does not count that either (ftrace has no
    such limit).  So every one of ours is the kernel's; the kernel's missing from ours equal
    the run's kernel_skips where the kernel counts them, and are at most 1 in 10 where it does
    not (the lab's 6.1 kernel: one CI run missed 1 of 13, in a softirq of `nvme connect`)."""
    ours = Counter(r["conn"] for r in lab.table("tcp_events") if r["event"] == "retransmit")
    kernel = Counter(_conn(k["saddr"], k["sport"], k["daddr"], k["dport"]) for k in lab.ftrace
                     if k["event"] == "tcp_retransmit_skb" and "4420" in (k["sport"], k["dport"]))
    assert sum(kernel.values()) > 0, "netem loss made no retransmission"
    assert not ours - kernel, ours - kernel   # nothing the kernel did not do
    missed = sum((kernel - ours).values())
    (run,) = lab.ds.runs()
    skips = run["kernel_skips"].get("tcp:tcp_retransmit_skb")
    if skips is not None:
        assert missed == skips
    else:
        assert missed <= max(1, sum(kernel.values()) // 10), (kernel - ours)
    socks = lab.reader["tcp_sockets"]["4420"]
    assert sum(s["retrans_total"] for s in socks) >= sum(kernel.values())


def test_tcp_rtt_present_and_plausible(lab):
    """RTT samples for every NVMe/TCP socket, none below the 2 x 2 ms netem puts on the path."""
    socks = lab.reader["tcp_sockets"]["4420"]
    assert len(socks) == 2 * lab.ns("tcp")["queue_count"]  # host and target end of each queue
    probes = [r for r in lab.table("tcp_events") if r["event"] == "probe"]
    by = defaultdict(list)
    for r in probes:
        by[r["conn"]].append(r["srtt_us"])
    want = {f"{s['local']}->{s['peer']}" for s in socks}
    assert want <= set(by), want - set(by)
    delay_us = 2 * 1000 * json.loads((lab.out / "config.json").read_text())["tcp_delay_ms"]
    assert all(delay_us <= v < 5_000_000 for c in want for v in by[c])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", ["no-qemu", "boot-timeout", "target-module-missing"])
def test_lab_failure_names_the_step_and_leaves_nothing(image, tmp_path, case):
    """A failing lab says which step failed and why, and leaves no QEMU process, no scratch
    files and no mount behind."""
    if os.environ.get("KVTRACE_LAB_RESULTS"):
        pytest.skip("checking an earlier run's results (KVTRACE_LAB_RESULTS)")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch), "KVTRACE_LAB_ACCEL": "tcg"}
    args = [str(HERE / "run.sh"), "--out", str(tmp_path / "out")]
    want = {
        "no-qemu": ("check", "qemu-system-none missing"),
        "boot-timeout": ("boot", "boot timeout"),
        "target-module-missing": ("target", "modprobe nvmet-tcp failed"),
    }[case]
    if case == "no-qemu":
        env["KVTRACE_LAB_QEMU"] = "qemu-system-none"
    elif case == "boot-timeout":
        args += ["--boot-timeout", "3"]
    else:
        env["KVTRACE_LAB_APPEND"] = "module_blacklist=nvmet_tcp"
    rc, err = _script(args, 600, env)
    assert rc != 0
    (line,) = [x for x in err.splitlines() if "FAILED" in x]
    assert f"FAILED at step '{want[0]}'" in line and want[1] in line, err
    for pid in re.findall(r"QEMU \(\w+, pid (\d+)\)", err):
        assert not Path(f"/proc/{pid}").exists() or "qemu" not in Path(f"/proc/{pid}/comm").read_text(), pid
    assert list(scratch.iterdir()) == []  # the scratch directory (NVMe image, QEMU's snapshot) is gone
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(tmp_path) not in mounts and str(CACHE) not in mounts
