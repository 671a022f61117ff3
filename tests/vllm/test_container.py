"""Live attach to a vLLM server in its own mount and pid namespaces (a container without the
image): its /tmp and /dev/shm are private, and the agent's pid means nothing inside.  The hook
is staged through /proc/PID/root, sees the agent through the flag the agent puts in the
server's own /dev/shm, records exactly what vLLM answers, and leaves when the agent goes
(detach or SIGKILL)."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.hook.transport import FLAG_PATH
from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer, vllm_python
from tests.helpers import reset_prefix_cache, wait_for
from tests.vllm.conftest import SERVER_ARGS, free_port, vllm_skip_reason
from tests.vllm.test_inject import Agent, hook_state
from tests.vllm_checks import check_requests

pytestmark = pytest.mark.root

WRAPPER = """#!/bin/sh
# vLLM's interpreter in new mount and pid namespaces, with private /tmp and /dev/shm
exec unshare --mount --pid --fork --mount-proc --propagation private sh -c \
  'mount -t tmpfs -o mode=1777 kvtrace-ctr-shm /dev/shm && mount -t tmpfs -o mode=1777 kvtrace-ctr-tmp /tmp && exec "$0" "$@"' \
  {python} "$@"
"""


@pytest.fixture(scope="module")
def ns_server():
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="kvtrace-ctr-", dir="/var/tmp"))   # outside the private /tmp
    wrapper = workdir / "python-in-namespaces"
    wrapper.write_text(WRAPPER.format(python=vllm_python()))
    wrapper.chmod(0o755)
    server = VllmServer(args=list(SERVER_ARGS), port=free_port(8140, 8159), python=str(wrapper),
                        env={"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1"}, workdir=workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _flag_inside(pid: int, agent_pid: int) -> Path:
    return Path(f"/proc/{pid}/root{FLAG_PATH}") / str(agent_pid)


def test_namespaced_server_is_traced_and_left_clean(ns_server, tmp_path):
    server = ns_server
    engine = server.processes()["engine"][0]
    # it really is apart: another pid and mount namespace, another /dev/shm and /tmp
    assert os.readlink(f"/proc/{engine}/ns/pid") != os.readlink("/proc/self/ns/pid")
    assert os.readlink(f"/proc/{engine}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    for d in ("/dev/shm", "/tmp"):
        assert os.stat(f"/proc/{engine}/root{d}").st_dev != os.stat(d).st_dev
    assert all(s["status"]["reason"] == "no kvtrace hook in this process" for s in hook_state(server))

    reset_prefix_cache(server.url)
    agent = Agent(server, tmp_path / "ds")
    assert any("injected in engine" in line for line in agent.lines), agent.lines
    inside = _flag_inside(engine, agent.proc.pid)
    assert inside.read_text() == f"{agent.proc.pid} lock\n"        # the agent's flag, in the server's /dev/shm
    reqs = workload.shared_prefix(seed=5, groups=2, per_group=2, prefix_len=400, suffix_len=200, fillers=1, filler_len=600)
    results = workload.run(server.url, server.model, reqs)
    time.sleep(1.5)
    state = hook_state(server)[0]["status"]
    assert state["installed"] is True, state    # the agent's pid is unknown inside: the lock says it is alive
    assert agent.stop() == 0, agent.lines
    assert all(not r.error for r in results)
    assert not inside.exists()
    assert all(s["status"]["installed"] is False for s in hook_state(server))

    ds = Dataset.open(tmp_path / "ds")
    check_requests(ds, results)   # cached tokens equal the responses', chunks tile every prompt
    # the hook's records carry the host's pids (the ones the kernel probes see), not the namespace's
    assert {h["pid"] for h in ds.table("hook_start").to_pylist()} <= set(server.processes()["engine"] + server.processes()["workers"])


def test_sigkilled_agent_hook_leaves_the_namespaced_server(ns_server, tmp_path):
    server = ns_server
    engine = server.processes()["engine"][0]
    agent = Agent(server, tmp_path / "ds")
    inside = _flag_inside(engine, agent.proc.pid)
    assert inside.exists()
    workload.run(server.url, server.model, workload.shared_prefix(seed=9, groups=1, per_group=2, fillers=0))
    agent.stop(signal.SIGKILL)
    assert inside.exists()   # a SIGKILLed agent leaves its file; its lock went with it

    def gone() -> bool:
        workload.send(server.url, server.model, workload.Request("poke", [7] * 32, 2))
        return hook_state(server)[0]["status"]["installed"] is False
    wait_for(gone, 60, "the hook to leave after its agent was SIGKILLed")
    assert "exited" in hook_state(server)[0]["status"]["reason"]
    assert not workload.send(server.url, server.model, workload.Request("after", [5] * 64, 2)).error
