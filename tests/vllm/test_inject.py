"""Live attach: the hook is injected into a running vLLM server that was started without the
plugin, checked against vLLM's own answers, removed on detach, and survives a SIGKILLed agent.
Refusals are one line each with the target untouched."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.errors import DatasetError
from kvtrace.inject import injector
from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer
from kvtrace.servers import registry

VLLM_HOOK = registry.kind("vllm").hook_module
from tests.helpers import reset_prefix_cache, wait_for
from tests.vllm.conftest import SERVER_ARGS, KvEventSink, free_port, vllm_skip_reason
from tests.vllm_checks import check_evictions, check_requests, removed_hashes

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """A vLLM server with the kvtrace plugin filtered out (VLLM_PLUGINS), KV events on."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("zmq")
    zport = free_port(8180, 8199)
    events = KvEventSink(zport).start()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    server = VllmServer(args=[*SERVER_ARGS, "--kv-events-config", json.dumps(kv)], port=free_port(8160, 8179),
                        env={"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1"}, workdir=tmp_path_factory.mktemp("plain"))
    server.start()
    try:
        yield server, events
    finally:
        server.stop()
        events.close()


def hook_state(server) -> list[dict]:
    procs = server.processes()
    return [injector.hook(p, "status", module=VLLM_HOOK) for p in procs["engine"] + procs["workers"]]


class Agent:
    def __init__(self, server, out):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(server.port), "--out", str(out)],
                                     stderr=subprocess.PIPE, text=True)
        self.lines = []
        while True:
            line = self.proc.stderr.readline()
            assert line, f"agent exited: {''.join(self.lines)}"
            self.lines.append(line)
            if "vLLM hook" in line and "engine" in line:
                break
        self.t_attached = time.monotonic_ns()

    def stop(self, sig=signal.SIGINT) -> int:
        self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.lines.append(err)
        return self.proc.returncode


def test_injected_hook_matches_vllm_and_leaves_on_detach(plain_server, tmp_path):
    server, events = plain_server
    # no kvtrace code in the server to begin with
    assert all(s["status"]["reason"] == "no kvtrace hook in this process" for s in hook_state(server))
    probes = [workload.Request(f"probe{i}", workload.tokens(__import__("random").Random(i), 300), 6) for i in range(3)]
    reset_prefix_cache(server.url)
    before = [r.token_ids for r in workload.run(server.url, server.model, probes)]

    reset_prefix_cache(server.url)
    agent = Agent(server, tmp_path / "ds")
    assert any("injected in engine" in l for l in agent.lines)
    t0 = agent.t_attached
    with_hook = [r.token_ids for r in workload.run(server.url, server.model, probes)]
    reqs = workload.shared_prefix(seed=7, groups=2, per_group=3, prefix_len=600, suffix_len=400, fillers=3, filler_len=1000)
    results = workload.run(server.url, server.model, reqs)
    time.sleep(1.5)
    t1 = time.monotonic_ns()
    assert agent.stop() == 0, agent.lines
    assert all(not r.error for r in results)
    assert with_hook == before  # temperature 0: identical completions with and without the hook

    # detached: the hook is gone from every process, and the server still serves
    for s in hook_state(server):
        assert s["status"]["installed"] is False
    assert not workload.send(server.url, server.model, probes[0]).error

    ds = Dataset.open(tmp_path / "ds")
    check_requests(ds, results)   # cached tokens equal the responses', chunks tile every prompt
    # evictions: the same multiset of hashes as vLLM's BlockRemoved events while attached
    check_evictions(ds, removed_hashes(events.between(t0, t1)))

    # a second attach works and does not double events
    agent2 = Agent(server, tmp_path / "ds2")
    workload.run(server.url, server.model, reqs[:3])
    time.sleep(1.5)
    assert agent2.stop() == 0
    ds2 = Dataset.open(tmp_path / "ds2")
    steps = ds2.table("step")["step"].to_pylist()
    assert steps and len(steps) == len(set(steps))
    keys = [(c["request"], c["attempt"], c["chunk_index"]) for c in ds2.table("chunk").to_pylist()]
    assert len(keys) == len(set(keys))
    assert sum(1 for h in ds2.table("hook_start").to_pylist() if h["role"] == "engine") == 1


def test_sigkilled_agent_leaves_a_serving_server_and_no_hook(plain_server, tmp_path):
    server, _ = plain_server
    agent = Agent(server, tmp_path / "ds")
    reqs = workload.shared_prefix(seed=11, groups=3, per_group=2, fillers=2)
    results: list = []
    killed = threading.Event()

    def load() -> None:   # rounds back to back until the agent is killed: the kill lands mid-workload
        while not killed.is_set():
            results.extend(workload.run(server.url, server.model, reqs, concurrency=2))

    t = threading.Thread(target=load)
    t.start()

    def flushed() -> bool:   # the agent has written steps of this workload (a flush every second)
        try:
            return Dataset.open(tmp_path / "ds").table("step").num_rows > 0
        except DatasetError:
            return False

    try:
        t0 = time.monotonic()
        wait_for(flushed, 60, "the agent's first flush of step rows")
        print(f"first steps flushed {time.monotonic() - t0:.2f} s after the workload started")
        assert t.is_alive(), "the workload failed before the agent flushed"
        agent.stop(signal.SIGKILL)
    finally:
        killed.set()
        if agent.proc.poll() is None:   # a failure above: detach cleanly, so the next test finds no hook
            agent.stop()
        t.join(300)
    assert results and len(results) % len(reqs) == 0 and all(not r.error for r in results)
    # the next steps notice the agent is gone (flag re-checked each second) and remove the hook
    time.sleep(1.5)
    workload.run(server.url, server.model, reqs[:2])
    states = hook_state(server)
    engine = states[0]["status"]
    assert engine["installed"] is False and "exited" in engine["reason"]
    assert Dataset.open(tmp_path / "ds").table("step").num_rows > 0  # what was flushed reads back


def run_inject(*args):
    return subprocess.run([sys.executable, "-m", "kvtrace", "inject", *args], capture_output=True, text=True, timeout=120)


def test_refusals_are_one_line_and_leave_the_target_untouched(plain_server, tmp_path):
    server, _ = plain_server
    # a Python process that is not vLLM
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        p = run_inject("--pid", str(other.pid))
        assert p.returncode == 3 and "not part of a vLLM or SGLang server" in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert other.poll() is None
    finally:
        other.kill()
    # ptrace denied: the EngineCore already has a tracer
    engine = server.processes()["engine"][0]
    if shutil.which("strace"):
        tracer = subprocess.Popen(["strace", "-p", str(engine), "-o", "/dev/null"], stderr=subprocess.DEVNULL)
        time.sleep(1)
        try:
            p = run_inject("--pid", str(engine))
            assert p.returncode == 3 and "ptrace" in p.stderr and "denied" in p.stderr, p.stderr
            assert "Traceback" not in p.stderr
        finally:
            tracer.terminate()
            tracer.wait(10)
    # a pid that exits during injection: a process that dies at once
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    p = run_inject("--pid", str(gone.pid))
    assert p.returncode == 3 and len(p.stderr.strip().splitlines()) == 1
    # the server never stopped serving and carries no hook
    assert not workload.send(server.url, server.model, workload.Request("after", [5] * 64, 2)).error
    assert all(s["status"]["installed"] is False for s in hook_state(server))
