"""Fixtures of the container tests: the agent image (built here from the Dockerfile, with the
wheel under test) and one real vLLM server in a container, shared by the tests of this folder."""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from kvtrace.demo import workload
from kvtrace.demo.server import vllm_python
from tests.container import podman
from tests.helpers import reset_prefix_cache
from tests.vllm.conftest import SERVER_ARGS, KvEventSink, vllm_skip_reason

KV_PORT = 5557


@pytest.fixture(scope="session")
def podman_ready():
    reason = podman.skip_reason() or vllm_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def agent_image(podman_ready, built_dist):
    t0 = time.monotonic()
    image = podman.build_image("--wheel", str(built_dist[0]))
    print(f"agent image {image} built in {time.monotonic() - t0:.0f} s")
    return image


@pytest.fixture(scope="session")
def vllm_container(podman_ready):
    """vLLM in its own mount, PID, network and UTS namespaces, KV events bound on its loopback."""
    base = podman.build_image("--base-only")
    workdir = Path(tempfile.mkdtemp(prefix="kvtrace-ctr-", dir="/var/tmp"))
    ctr = podman.VllmContainer(base, vllm_python(), [*SERVER_ARGS, *podman.kv_events_args(KV_PORT)], workdir)
    t0 = time.monotonic()
    try:
        ctr.start()
        print(f"vLLM container {ctr.name} answered in {time.monotonic() - t0:.0f} s")
        yield ctr
    finally:
        ctr.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class Attached:
    """An agent process (``cmd``), started and read until the hook is in EngineCore."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=podman.ENV)
        self.lines: list[str] = []
        while True:
            line = self.proc.stderr.readline()
            assert line, f"the agent exited: {''.join(self.lines)}"
            self.lines.append(line)
            if "vLLM hook" in line and "engine" in line:
                break

    def stop(self, sig: int = 2, timeout: float = 120) -> int:
        self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.lines.append(err)
        return self.proc.returncode

    @property
    def text(self) -> str:
        return "".join(self.lines)


def traced_workload(ctr, agent_cmd: list[str], seed: int):
    """Attach ``agent_cmd``, run a shared-prefix workload inside the container's network, stop:
    (results, the test's own KV-event batches while attached, the agent)."""
    sink = KvEventSink(KV_PORT, connect=True, netns=ctr.netns).start()
    try:
        ctr.call(reset_prefix_cache, ctr.url)
        agent = Attached(agent_cmd)
        t0 = time.monotonic_ns()
        reqs = workload.shared_prefix(seed=seed, groups=2, per_group=3, prefix_len=600, suffix_len=400,
                                      fillers=3, filler_len=1000)
        results = ctr.call(workload.run, ctr.url, ctr.model, reqs)
        time.sleep(1.5)   # the last KV-event batch reaches both subscribers
        t1 = time.monotonic_ns()
        rc = agent.stop()
        assert rc == 0, agent.text
        assert all(not r.error for r in results), [r.error for r in results if r.error]
        return results, sink.between(t0, t1), agent
    finally:
        sink.close()


def check_run(ds, ctr) -> dict:
    """The run traced the container's three processes and read both streams inside its network
    namespace without a loss; the run's sidecar stats by name."""
    run = ds.runs()[0]
    procs = ctr.processes()
    assert sorted(run["pids"]) == sorted(procs["api"] + procs["engine"] + procs["workers"])
    assert {h["pid"] for h in ds.table("hook_start").to_pylist()} <= set(procs["engine"] + procs["workers"])
    side = {s["name"]: s for s in json.loads(run["sidecars"])}
    assert side["kv_events"]["missing"] == 0 and side["kv_events"]["batches"] > 0
    assert side["server_metrics"]["scrape_errors"] == 0 and side["server_metrics"]["scrapes"] >= 2
    return side
