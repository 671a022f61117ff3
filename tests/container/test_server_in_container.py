"""A vLLM server in a podman container (own mount, PID, network and UTS namespaces, its own
root filesystem), attached from the host with ``kvtrace attach --port 8000``: found with the
host's pids and the container's own port and network namespace, the hook injected through
/proc/PID/root, KV events and /metrics read inside its network namespace, and the records
checked against vLLM's responses and its own KV-event stream."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.inject import injector
from kvtrace.servers import registry

VLLM_HOOK = registry.kind("vllm").hook_module
from tests.container.conftest import check_run, traced_workload
from tests.vllm.test_streams import scrape_value
from tests.vllm_checks import check_evictions, check_requests, removed_hashes

pytestmark = pytest.mark.root


def hook_installed(ctr) -> list[bool]:
    procs = ctr.processes()
    return [injector.hook(p, "status", module=VLLM_HOOK)["status"]["installed"] for p in procs["engine"] + procs["workers"]]


def test_servers_finds_the_container_with_host_pids_and_its_own_port(vllm_container):
    ctr = vllm_container
    assert os.readlink(f"/proc/{ctr.pid}/ns/uts") != os.readlink("/proc/self/ns/uts")
    r = subprocess.run([sys.executable, "-m", "kvtrace", "servers", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (mine,) = [s for s in json.loads(r.stdout) if s["pid"] == ctr.pid]
    procs = ctr.processes()
    assert (mine["engine_pids"], mine["worker_pids"]) == (procs["engine"], procs["workers"])
    assert mine["port"] == 8000 and mine["in_container"] is True
    assert mine["netns"] == ctr.netns and mine["netns_id"] == os.readlink(ctr.netns)
    assert mine["version"] and mine["kv_events"]["endpoint"] == "tcp://*:5557"


def test_attach_from_the_host(vllm_container, tmp_path):
    ctr = vllm_container
    hits_before = ctr.call(scrape_value, f"{ctr.url}/metrics", "vllm:prefix_cache_hits_total")
    cmd = [sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", "8000", "--out", str(tmp_path / "ds"),
           "--metrics-interval", "0.5"]
    results, batches, agent = traced_workload(ctr, cmd, seed=21)
    assert f"inside the server's network namespace {os.readlink(ctr.netns)}" in agent.text, agent.text
    assert not any(hook_installed(ctr)), "the hook stayed after detach"

    ds = Dataset.open(tmp_path / "ds")
    got = check_requests(ds, results)
    evicted = check_evictions(ds, removed_hashes(batches))
    side = check_run(ds, ctr)
    # /metrics as the agent scraped it inside the namespace: its hits grew by the responses' cached tokens
    hits = [m for m in ds.table("server_metrics").to_pylist() if m["name"] == "vllm:prefix_cache_hits_total"]
    hits.sort(key=lambda m: m["ts_ns"])
    assert hits[0]["value"] == hits_before
    assert hits[-1]["value"] - hits[0]["value"] == got["cached_tokens"]
    print(f"container, agent on the host: {got['requests']} requests, {got['cached_tokens']} cached tokens, "
          f"{got['chunks']} chunks, {evicted} evictions, {side['kv_events']['batches']} KV-event batches")
