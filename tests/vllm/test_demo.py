"""`kvtrace demo`, the main job README gives, run as a user runs it: exit 0, and its report
checked row by row against the workload it sends (regenerated here from the same seed) and
against the dataset it leaves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrace.demo import workload
from kvtrace.demo.server import TINY_LLAMA, vllm_python
from tests.conftest import run_kvtrace

pytestmark = pytest.mark.root

ROW = re.compile(r"^  (\S+)\s+(\d+)\s+(\d+)\s+(\d+)\+(\d+)\s+(\d+)\s+(\d+)\s+([\d,]+)  (ok|MISMATCH)$")
BLOCK, PREFIX = 32, 640


def _skip_without_vllm():
    if not Path(vllm_python()).exists():
        pytest.skip(f"needs the vLLM venv ({vllm_python()}; make setup-vllm)")


def test_vllm_demo_report_matches_its_workload_and_dataset(tmp_path):
    _skip_without_vllm()
    out = tmp_path / "ds"
    p = run_kvtrace("demo", "--out", str(out), timeout=900)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    rows = {m[1]: m for m in map(ROW.match, p.stdout.splitlines()) if m}
    # the demo's workload, rebuilt from its seed: every request reported once, in order, all ok
    reqs = workload.shared_prefix(seed=1, groups=3, per_group=3, prefix_len=PREFIX, suffix_len=360, fillers=3,
                                  filler_len=1000)
    assert list(rows) == [r.rid for r in reqs], p.stdout
    assert all(m[9] == "ok" for m in rows.values())
    prompt = {r.rid: len(r.prompt) for r in reqs}
    for rid, m in rows.items():
        assert int(m[2]) == prompt[rid]
        assert int(m[3]) == int(m[4]) + int(m[5])                        # vLLM's cached = kvtrace's local + external
        assert int(m[6]) == -(-(prompt[rid] - int(m[3])) // 256)         # chunks of the 256-token budget
    # what the demo promises: prefix hits inside each group, evictions by the fillers, and the
    # first prompt again served from storage (external hits and bytes loaded)
    for g in range(3):
        for i in (1, 2):
            assert int(rows[f"g{g}-r{i}"][4]) == PREFIX // BLOCK * BLOCK, rows[f"g{g}-r{i}"][0]
    assert sum(int(m[7]) for m in rows.values()) > 0
    again = rows["again-g0-r0"]
    assert int(again[5]) > 0, again[0]
    # the bytes loaded are the external blocks' K and V of every layer in the model's bf16
    m = TINY_LLAMA
    block_bytes = 2 * m["num_hidden_layers"] * BLOCK * m["num_key_value_heads"] * (m["hidden_size"] // m["num_attention_heads"]) * 2
    for rid, row in rows.items():
        assert int(row[8].replace(",", "")) == int(row[5]) // BLOCK * block_bytes, row[0]

    from kvtrace.dataset.reader import Dataset

    ds = Dataset.open(out)
    assert not ds.problems, ds.problems
    (run,) = ds.runs()
    assert not any(run["lost_events"].values()) and run["dropped_events"] == 0, run
    evicts = ds.table("evict").to_pylist()
    loads = [r for r in ds.table("kv_load").to_pylist() if r["request"].startswith("cmpl-again-g0-r0-")]
    assert len(evicts) == sum(int(m[7]) for m in rows.values())
    assert sum(r["nbytes"] for r in loads) == int(again[8].replace(",", ""))
    # the same from vLLM's scheduler alone (any connector; kv_alloc): per request with an external
    # hit, its tokens, blocks and bytes, equal to what kvtrace's file connector reported itself
    allocs = {r["request"]: r for r in ds.table("kv_alloc").to_pylist()}
    own = {}
    for r in ds.table("kv_load").to_pylist():
        if r["request"]:
            b, n = own.get(r["request"], (0, 0))
            own[r["request"]] = (b + r["blocks"], n + r["nbytes"])
    assert {rid: (a["blocks"], a["nbytes"]) for rid, a in allocs.items()} == own
    assert all(a["connector"] == "KvtraceFileConnector" and a["async"] == 0 and a["external"] == a["blocks"] * BLOCK
               for a in allocs.values())
    ext = {r["request"]: r["cached_external"] for r in ds.table("admit").to_pylist() if r["cached_external"]}
    assert {rid: a["external"] for rid, a in allocs.items()} == ext
    assert f"dataset: {out}" in p.stdout
    # vLLM's own accounts, recorded beside the hook's: its /metrics counters rose by the report's
    # local and loaded-back tokens, and its KV-event stream removed as many blocks as were evicted
    rises = {}
    for r in sorted(ds.table("server_metrics").to_pylist(), key=lambda r: r["ts_ns"]):
        if r["name"] in ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"):
            rises.setdefault(r["name"], []).append(r["value"])
    assert rises["vllm:prefix_cache_hits_total"][-1] - rises["vllm:prefix_cache_hits_total"][0] == sum(int(m[4]) for m in rows.values())
    assert (rises["vllm:external_prefix_cache_hits_total"][-1] - rises["vllm:external_prefix_cache_hits_total"][0]
            == sum(int(m[5]) for m in rows.values()))
    kv = ds.table("kv_events").to_pylist()
    assert sum(1 for e in kv if e["event"] == "BlockRemoved") == len(evicts)
    print(f"demo: {len(rows)} requests ok; evictions {len(evicts)}; again-g0-r0 cached {again[3]} "
          f"= {again[4]} local + {again[5]} loaded back, {again[8]} bytes")


def test_io_demo_matches_its_workload(tmp_path):
    p = run_kvtrace("demo", "--io", "--out", str(tmp_path / "ds"), timeout=300)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    checks = re.findall(r"^  (.+?)\s+kvtrace\s+([\d,]+)\s+workload\s+([\d,]+)\s+(ok|MISMATCH)$", p.stdout, re.M)
    assert [c[0] for c in checks] == ["block requests", "block bytes", "io_uring reads", "io_uring bytes"], p.stdout
    assert all(c[1] == c[2] and c[3] == "ok" for c in checks)
    got = {c[0]: int(c[1].replace(",", "")) for c in checks}
    assert got["block bytes"] > 0 and got["io_uring bytes"] > 0
