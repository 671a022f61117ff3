"""Real containers for the tests: podman (Debian's, with Debian's runc) running images built
here from Debian packages (deploy/container/build-image: mmdebstrap, podman import, podman
build of deploy/container/Dockerfile).

``VllmContainer`` runs a real vLLM server in a container of its own: own mount, PID, network
(loopback only: ``--network=none``) and UTS namespaces, on the base image's root filesystem.
vLLM's environment is mounted read-only at its own path (a 3 GB venv is not copied into an
image for every run); the model directory too.  The test reaches it the way kvtrace does,
from a thread inside its network namespace.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from kvtrace.host import netns
from kvtrace.demo.server import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
CONF = Path(__file__).with_name("containers.conf")   # runc, cgroupfs, no ulimits: this VM's needs
ENV = {**os.environ, "CONTAINERS_CONF": str(CONF)}


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (runs in CI as root): containers and BPF"
    for tool in ("podman", "runc", "mmdebstrap"):
        if not shutil.which(tool):
            return f"needs {tool} (apt-get install podman runc mmdebstrap; scripts/setup-host does)"
    return None


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=ENV)
    if check and r.returncode:
        raise RuntimeError(f"podman {' '.join(args[:3])}… exited {r.returncode}: {r.stderr.strip()[-800:]}")
    return r


def build_image(*args: str) -> str:
    """deploy/container/build-image with these arguments: the image's name."""
    r = subprocess.run([str(REPO / "deploy/container/build-image"), *args],
                       capture_output=True, text=True, timeout=1200, env=ENV)
    if r.returncode:
        raise RuntimeError(f"build-image exited {r.returncode}: {r.stderr.strip()[-1500:]}")
    return r.stdout.strip().splitlines()[-1]


def venv_mounts(python: str) -> list[str]:
    """Read-only mounts that make a venv's interpreter run inside another root: the venv and
    the Python it was made from (pyvenv.cfg's ``home``)."""
    venv = Path(python).parent.parent
    home = next((l.split("=", 1)[1].strip() for l in (venv / "pyvenv.cfg").read_text().splitlines()
                 if l.split("=")[0].strip() == "home"), None)
    dirs = [venv] + ([Path(home).parent] if home and not home.startswith("/usr/") else [])
    return [f"--volume={d}:{d}:ro" for d in dirs]


class VllmContainer:
    """``podman run`` of a vLLM OpenAI server on port ``port`` of its own loopback."""

    def __init__(self, image: str, python: str, args: list[str], workdir: Path, port: int = 8000,
                 name: str | None = None):
        self.image, self.python, self.args, self.workdir, self.port = image, python, args, workdir, port
        self.name = name or f"kvtrace-vllm-{uuid.uuid4().hex[:8]}"
        self.model = "/models/tiny-llama"
        self.pid = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def netns(self) -> str:
        return f"/proc/{self.pid}/ns/net"

    def start(self, timeout: float = 600) -> "VllmContainer":
        model = write_tiny_model(self.workdir / "tiny-llama")
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
               "--port", str(self.port), "--enforce-eager", *self.args]   # no C++ compiler in the image: no inductor
        podman("run", "--detach", "--name", self.name, "--network=none", "--hostname", "vllm-in-container",
               "--shm-size=1g", *venv_mounts(self.python), f"--volume={model}:{self.model}:ro",
               "--env=VLLM_PLUGINS=", "--env=VLLM_SERVER_DEV_MODE=1", "--env=VLLM_CPU_KVCACHE_SPACE=1",
               self.image, *cmd)
        self.pid = int(podman("inspect", "--format", "{{.State.Pid}}", self.name).stdout.strip())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if podman("inspect", "--format", "{{.State.Running}}", self.name).stdout.strip() != "true":
                raise RuntimeError(f"the vLLM container exited:\n{self.logs()}")
            if self.call(self._healthy):
                return self
            time.sleep(2)
        raise RuntimeError(f"vLLM in its container did not answer within {timeout:.0f} s:\n{self.logs()}")

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def call(self, fn, *args, timeout: float = 900):
        """``fn(*args)`` from inside the container's network namespace."""
        return netns.call(self.netns, fn, *args, timeout=timeout)

    def processes(self) -> dict[str, list[int]]:
        """Host pids by vLLM's process titles (as the host sees them)."""
        import psutil

        out = {"api": [self.pid], "engine": [], "workers": []}
        for c in psutil.Process(self.pid).children(recursive=True):
            name = c.name()
            if name.startswith("VLLM::EngineCor"):
                out["engine"].append(c.pid)
            elif name.startswith("VLLM::Worker"):
                out["workers"].append(c.pid)
        return out

    def logs(self, n: int = 40) -> str:
        r = podman("logs", "--tail", str(n), self.name, check=False)
        return (r.stdout + r.stderr)[-4000:]

    def stop(self) -> None:
        podman("rm", "--force", "--time", "10", self.name, check=False, timeout=120)


def kv_events_args(port: int = 5557) -> list[str]:
    """vLLM binds its KV-event publisher on its own loopback, as in a pod."""
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{port}"})]
