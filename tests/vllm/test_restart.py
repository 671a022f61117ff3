"""vLLM restarted while kvtrace is attached, against a real vLLM CPU server restarted on the
same port: by default kvtrace stops by itself with one line and a complete dataset; with
--on-restart follow it finds the new processes, traces them with the kernel probes and
injects the hook again, and its records of the new server agree with vLLM's own answers."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pyarrow.compute as pc
import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.inject import injector
from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer
from kvtrace.servers import registry

VLLM_HOOK = registry.kind("vllm").hook_module
from tests.vllm.conftest import SERVER_ARGS, free_port, vllm_skip_reason

pytestmark = [pytest.mark.root, pytest.mark.long]


# The hook finds its agent through a flag file; a private one keeps other kvtrace agents on
# this host (other test runs) from switching this test's hook on or off.
FLAG = f"/dev/shm/kvtrace-agent-restart-test-{os.getpid()}"


def start_server(port: int, workdir) -> VllmServer:
    # no plugin: the hook gets in only by live injection
    return VllmServer(args=list(SERVER_ARGS), port=port, env={"VLLM_PLUGINS": "", "KVTRACE_FLAG": FLAG},
                      workdir=workdir).start()


class Agent:
    def __init__(self, port: int, out, *extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(port), "--out", str(out),
                                      *extra], stderr=subprocess.PIPE, text=True, env={**os.environ, "KVTRACE_FLAG": FLAG})
        self.lines: list[str] = []
        self.wait_for("vLLM hook injected in engine")

    def wait_for(self, text: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            assert line, f"agent exited: {''.join(self.lines)}"
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} from the agent: {''.join(self.lines)}")

    def rest(self, timeout: float = 120) -> int:
        _, err = self.proc.communicate(timeout=timeout)
        self.lines.append(err)
        return self.proc.returncode


def requests(seed: int, n: int = 4) -> list[workload.Request]:
    rng = random.Random(seed)
    prefix = workload.tokens(rng, 320)
    return [workload.Request(f"s{seed}-r{i}", prefix + workload.tokens(rng, 100 + 20 * i), 4) for i in range(n)]


def engine_hooked(server: VllmServer) -> bool:
    return any(injector.hook(p, "status", module=VLLM_HOOK)["status"]["installed"] for p in server.processes()["engine"])


@pytest.fixture(scope="module", autouse=True)
def _flag_dir():
    """The agent flag directory of these tests' own, gone with them."""
    yield
    shutil.rmtree(FLAG, ignore_errors=True)


@pytest.fixture(scope="module")
def port():
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    return free_port(8600, 8699)


def test_default_exits_with_one_line_and_a_complete_dataset(port, tmp_path):
    server = start_server(port, tmp_path / "vllm")
    try:
        agent = Agent(port, tmp_path / "ds")
        results = workload.run(server.url, server.model, requests(1))
        assert all(not r.error for r in results)
        time.sleep(1.5)
        api = server.proc.pid
        t_stop = time.monotonic()
        server.stop()
    finally:
        server.stop()
    rc = agent.rest(timeout=120)
    took = time.monotonic() - t_stop
    assert rc == 0, agent.lines
    said = [l for l in "".join(agent.lines).splitlines() if "exited; stopping" in l]
    assert len(said) == 1 and f"port {port} (pid {api})" in said[0] and "--on-restart follow" in said[0]
    assert "Traceback" not in "".join(agent.lines)
    assert took < 60
    ds = Dataset.open(tmp_path / "ds")
    (run,) = ds.runs()
    assert run["status"] == "complete" and ds.problems == []
    (side,) = [s for s in json.loads(run["sidecars"]) if s["name"] == "vllm_server"]
    assert side["on_restart"] == "exit" and side["restarts"] == []
    # what was recorded before the server went away is all there
    admit = ds.table("admit").to_pylist()
    for r in results:
        assert any(a["request"].startswith(f"cmpl-{r.rid}-") for a in admit), r.rid


def test_follow_retargets_and_reinjects_on_the_same_port(port, tmp_path):
    first = start_server(port, tmp_path / "vllm1")
    second = None
    try:
        before = first.processes()
        agent = Agent(port, tmp_path / "ds", "--on-restart", "follow")
        r1 = workload.run(first.url, first.model, requests(2))
        assert all(not r.error for r in r1)
        time.sleep(1.5)
        first.stop()
        agent.wait_for("waiting for a vLLM server on port", timeout=60)
        second = start_server(port, tmp_path / "vllm2")
        after = second.processes()
        back = agent.wait_for("again after", timeout=120)
        assert f"tracing pid {after['api'][0]}" in back and "hook injected again in" in back
        assert any("injected in engine" in l and str(after["engine"][0]) in l for l in agent.lines)
        assert engine_hooked(second)
        r2 = workload.run(second.url, second.model, requests(3))
        assert all(not r.error for r in r2)
        time.sleep(1.5)
        agent.proc.send_signal(signal.SIGINT)
        assert agent.rest() == 0, agent.lines
        assert not engine_hooked(second)      # the re-injected hook left with the agent
        assert not workload.send(second.url, second.model, requests(4)[0]).error
    finally:
        first.stop()
        if second is not None:
            second.stop()
    ds = Dataset.open(tmp_path / "ds")
    (run,) = ds.runs()
    assert run["status"] == "complete"
    old_pids = before["api"] + before["engine"] + before["workers"]
    new_pids = after["api"] + after["engine"] + after["workers"]
    assert set(old_pids) | set(new_pids) <= set(run["pids"])
    (side,) = [s for s in json.loads(run["sidecars"]) if s["name"] == "vllm_server"]
    (restart,) = side["restarts"]
    assert (restart["old_pid"], restart["new_pid"]) == (before["api"][0], after["api"][0])
    assert set(restart["reinjected"]) >= set(after["engine"]) and restart["found_ns"] > restart["gone_ns"]
    # the hook started once in each EngineCore, and steps came from both
    starts = [h for h in ds.table("hook_start").to_pylist() if h["role"] == "engine"]
    assert sorted(h["pid"] for h in starts) == sorted(before["engine"] + after["engine"])
    steps = ds.table("step")
    assert set(steps["pid"].to_pylist()) >= set(before["engine"]) | set(after["engine"])
    # the new server's requests, as vLLM answered them: cached tokens and prompt lengths
    admit = {a["request"]: a for a in ds.table("admit").to_pylist() if a["attempt"] == 0}
    for r in r1 + r2:
        (a,) = [v for k, v in admit.items() if k.startswith(f"cmpl-{r.rid}-")]
        assert a["cached_local"] + a["cached_external"] == r.cached_tokens and a["prompt_len"] == r.prompt_tokens
    assert any(r.cached_tokens for r in r2)
    # the kernel probes followed: the new processes' own I/O is in the dataset, and the old ones' exits
    io = ds.table("file_io")
    assert set(pc.unique(io["pid"]).to_pylist()) & set(new_pids)
    exits = {p["pid"] for p in ds.table("processes").to_pylist() if p["event"] == "exit"}
    assert set(before["api"]) <= exits
