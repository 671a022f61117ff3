"""The agent itself in a container (the image built from deploy/container/Dockerfile with the
wheel under test), as the DaemonSet runs it: the host's PID namespace, a network namespace of
its own, only the capabilities kvtrace declares, tracefs and the host's kernel headers
mounted; attached to the vLLM server in its other container, with the same exact checks."""
from __future__ import annotations

import uuid

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.host.privileges import AGENT_LEAST
from tests.container.conftest import check_run, traced_workload
from tests.container.podman import podman
from tests.container.test_server_in_container import hook_installed
from tests.vllm_checks import check_evictions, check_requests, removed_hashes

pytestmark = pytest.mark.root

MOUNTS = ["/sys/kernel/tracing:ro", "/lib/modules:ro", "/usr/src:ro"]   # as the DaemonSet mounts them


def agent_command(image: str, out, name: str) -> list[str]:
    caps = [f"--cap-add={c.removeprefix('CAP_')}" for c in AGENT_LEAST]
    vols = [f"--volume={m.split(':')[0]}:{m}" for m in MOUNTS] + [f"--volume={out}:/data"]
    return ["podman", "run", "--rm", "--name", name, "--pid=host", "--network=none", "--cap-drop=all", *caps,
            *vols, image, "attach", "--quiet", "--port", "8000", "--out", "/data/ds", "--metrics-interval", "0.5"]


def test_agent_in_a_container_traces_a_server_in_another(agent_image, vllm_container, tmp_path):
    ctr = vllm_container
    name = f"kvtrace-agent-{uuid.uuid4().hex[:8]}"
    try:
        results, batches, agent = traced_workload(ctr, agent_command(agent_image, tmp_path, name), seed=31)
    finally:
        podman("rm", "--force", name, check=False)
    assert not any(hook_installed(ctr)), "the hook stayed after the agent's container stopped"

    ds = Dataset.open(tmp_path / "ds")
    got = check_requests(ds, results)
    evicted = check_evictions(ds, removed_hashes(batches))
    check_run(ds, ctr)
    print(f"agent and server each in a container: {got['requests']} requests, {got['cached_tokens']} cached "
          f"tokens, {got['chunks']} chunks, {evicted} evictions")
