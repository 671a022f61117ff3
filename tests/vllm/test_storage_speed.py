"""A storage tier whose speed is real: kvtrace's file connector on an ext4 file system on a loop
device, read with O_DIRECT by a vLLM server in a blkio cgroup whose reads of that device are
throttled (cgroup v1 blkio.throttle.read_bps_device).  Three runs of one workload:

  base   no KV connector: evicted prefixes are recomputed
  slow   the tier, reads throttled to SLOW bytes/s
  fast   the tier, reads throttled to FAST bytes/s

Checked: the tier's loads really reach the device (its O_DIRECT read system calls and the
kernel's count of the bytes the server's cgroup read from the device equal the connector's load
bytes); `kvtrace
compare base slow` gives each figure as each run's own `analyze --json` and a failing gate
exits 8; `kvtrace whatif slow --storage-tier file@FAST` predicts the fast run's TTFT p50 within
25% and its hit rate within 2 points.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer
from tests.vllm.conftest import free_port, vllm_skip_reason
from tests.vllm.test_inject import Agent

pytestmark = [pytest.mark.root, pytest.mark.long]

SLOW, FAST = 4 << 20, 12 << 20          # bytes/s
CONCURRENCY = 4   # requests in flight: loads back to back, so the throttle's rate is the device's speed
BLKIO = Path("/sys/fs/cgroup/blkio")
ARGS = ["--block-size", "32", "--enable-prefix-caching", "--max-num-batched-tokens", "256",
        "--num-gpu-blocks-override", "122", "--max-model-len", "2048", "--enable-prompt-tokens-details"]
REPO = Path(__file__).resolve().parents[2]


def requests() -> list[workload.Request]:
    """12 new 1,000-token prompts, then all 12 twice more: 384 blocks through a 121-block cache,
    so every repeat misses the local cache (and, with the tier, is loaded back)."""
    import random

    rnd = random.Random(2027)
    prompts = [workload.tokens(rnd, 1000) for _ in range(12)]
    # one output token: a request ends with its prefill, so the device idles as little as the
    # client's round trip between loads (the throttle banks no credit for a speed it did not use)
    return [workload.Request(f"r{k}-p{i}", p, 1) for k in range(3) for i, p in enumerate(prompts)]


def sh(*cmd) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        pytest.skip("needs cgroup v1 blkio throttling (/sys/fs/cgroup/blkio)")
    if not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
        pytest.skip("needs losetup and mkfs.ext4")
    base = tmp_path_factory.mktemp("tier")
    img, mnt = Path("/var/tmp") / f"kvtrace-tier-{os.getpid()}.img", base / "mnt"
    sh("truncate", "-s", "512M", str(img))
    sh("mkfs.ext4", "-q", "-F", str(img))
    dev = sh("losetup", "--find", "--show", "--direct-io=on", str(img))
    mnt.mkdir()
    cg = BLKIO / f"kvtrace-test-{os.getpid()}"
    try:
        sh("mount", dev, str(mnt))
        cg.mkdir()
        yield {"dev": dev, "majmin": sh("lsblk", "-dno", "MAJ:MIN", dev).strip(), "mnt": mnt, "cgroup": cg, "base": base}
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        subprocess.run(["losetup", "-d", dev], check=False)
        img.unlink(missing_ok=True)
        if cg.exists():
            for p in (cg / "cgroup.procs").read_text().split():
                (BLKIO / "cgroup.procs").write_text(p)
            cg.rmdir()


def cgroup_read_bytes(cg: Path, majmin: str) -> int:
    for line in (cg / "blkio.throttle.io_service_bytes").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == majmin and parts[1] == "Read":
            return int(parts[2])
    return 0


def record(device, name: str, bps: int | None) -> dict:
    """One run: a fresh server (with the tier at bps, or none), attached to live, the workload sent."""
    cg, majmin = device["cgroup"], device["majmin"]
    (cg / "blkio.throttle.read_bps_device").write_text(f"{majmin} {bps or 0}")
    args = list(ARGS)
    blocks = device["mnt"] / name
    if bps:
        cfg = {"kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
               "kv_connector_extra_config": {"path": str(blocks), "direct_io": True, "stats_dir": str(blocks) + "-stats"}}
        args += ["--kv-transfer-config", json.dumps(cfg)]
    work = device["base"] / name
    srv = VllmServer(args=args, port=free_port(8100, 8179), workdir=work, cgroup=str(cg), env={"VLLM_PLUGINS": ""})
    srv.start()
    try:
        agent = Agent(srv, work / "ds")
        read0 = cgroup_read_bytes(cg, majmin)
        results = workload.run(srv.url, srv.model, requests(), concurrency=CONCURRENCY)
        time.sleep(1.5)
        assert agent.stop() == 0, agent.lines
        read = cgroup_read_bytes(cg, majmin) - read0
        worker = srv.processes()["workers"][0]
    finally:
        srv.stop()
    assert not any(r.error for r in results)
    stats = json.loads((Path(str(blocks) + "-stats") / "worker.json").read_text()) if bps else {}
    return {"ds": work / "ds", "results": results, "cgroup_read": read, "worker": worker, "stats": stats}


@pytest.fixture(scope="module")
def runs(device):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    return {name: record(device, name, bps) for name, bps in (("base", None), ("slow", SLOW), ("fast", FAST))}


def kvtrace(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def analyze(ds) -> dict:
    p = kvtrace("analyze", ds, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_loads_reach_the_device(runs, device):
    """O_DIRECT reads, so no load is a page-cache hit: the connector's load bytes equal its read
    system calls on the block files (kvtrace's file_io) and the bytes the kernel read from the
    device for the server's cgroup (blkio.throttle.io_service_bytes)."""
    from kvtrace.dataset.reader import Dataset

    for name in ("slow", "fast"):
        r = runs[name]
        ds = Dataset.open(r["ds"])
        loads = sum(x["nbytes"] for x in ds.table("kv_load").to_pylist() if x["source"] == "kvtrace-file")
        reads = sum(x["bytes"] * max(x["weight"], 1) for x in ds.table("file_io").to_pylist()
                    if x["pid"] == r["worker"] and x["syscall"].startswith("pread") and f"/{name}/" in x["path"])
        assert loads == r["stats"]["load_bytes"] == reads >= 24 * 31 * 65536, (name, loads, reads, r["stats"])
        assert 0 <= r["cgroup_read"] - loads < 1 << 20, (name, r["cgroup_read"], loads)


def test_compare_base_against_the_tier(runs):
    p = kvtrace("compare", runs["base"]["ds"], runs["slow"]["ds"], "--json")
    assert p.returncode == 0, p.stderr
    cmp = json.loads(p.stdout)
    base, slow = analyze(runs["base"]["ds"]), analyze(runs["slow"]["ds"])
    from kvtrace.analysis import compare

    where = {n: w for n, w, _, _ in compare.FIGURES}
    for f in cmp["figures"]:
        assert f["base"] == compare.figure(base, where[f["figure"]]), f["figure"]
        assert f["new"] == compare.figure(slow, where[f["figure"]]), f["figure"]
    by = {f["figure"]: f for f in cmp["figures"]}
    assert by["hit_rate_storage"]["base"] == 0 and by["hit_rate_storage"]["new"] > 0.6
    assert by["storage_read_gb_per_s"]["new"] > 0
    # a gate the tier cannot meet: TTFT p50 down by 99%
    g = kvtrace("compare", runs["base"]["ds"], runs["slow"]["ds"], "--gate", "ttft_p50<=-99%", "--gate",
                "hit_rate>=+0.5")
    assert g.returncode == 8 and "gate ttft_p50<=-99% failed" in g.stderr, g.stderr
    print("compare base slow:", json.dumps({k: [by[k]["base"], by[k]["new"]] for k in
                                            ("ttft_p50", "output_tokens_per_s", "hit_rate", "storage_read_gb_per_s")}))


def test_whatif_predicts_the_other_speed(runs):
    fast = analyze(runs["fast"]["ds"])
    p = kvtrace("whatif", runs["slow"]["ds"], "--storage-tier", f"file@{FAST / 1e9}", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    (pred,) = res["predictions"]
    real_ttft, real_hit = fast["service"]["ttft_p50_ns"], fast["reuse"]["hit_rate"]
    err = abs(pred["ttft_p50_ns"] - real_ttft) / real_ttft
    print(f"whatif slow->fast: TTFT p50 predicted {pred['ttft_p50_ns'] / 1e6:.1f} ms, real {real_ttft / 1e6:.1f} ms "
          f"({100 * err:.1f}%); hit rate {pred['hit_rate']:.4f} vs {real_hit:.4f}; model {res['storage_model']}")
    assert err <= 0.25
    assert abs(pred["hit_rate"] - real_hit) <= 0.02
    # and the recorded speed itself is what the model read off the slow run's reads
    assert res["storage_model"]["recorded_read_gbps"] == pytest.approx(SLOW / 1e9, rel=0.25)
