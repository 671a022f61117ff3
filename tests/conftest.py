"""Shared test setup: the `root` marker skips with a stated reason where capture cannot run; the
tests of tests/vllm, tests/sglang, tests/lmcache, tests/container and tests/lab carry their
resource's marker and `slow` (pyproject.toml lists the markers; `make unit` runs what is not slow)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KVTRACE = [sys.executable, "-m", "kvtrace"]


def _root_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (runs in CI as root): BPF capture"
    try:
        import bcc  # noqa: F401
    except Exception as e:
        return f"needs bcc (apt-get install python3-bpfcc; run from a --system-site-packages venv): {e}"
    if not Path("/sys/kernel/tracing/events").is_dir():
        return "needs tracefs mounted at /sys/kernel/tracing (scripts/setup-host)"
    return None


# Every test in these directories needs the resource of the same name and takes minutes.
RESOURCE_DIRS = {"vllm": "vllm", "sglang": "sglang", "lmcache": "lmcache", "container": "container", "lab": "lab"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO).parts
        resource = RESOURCE_DIRS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None
        if resource:
            item.add_marker(getattr(pytest.mark, resource))
            item.add_marker(pytest.mark.slow)
    reason = _root_skip_reason()
    if reason is None:
        return
    for item in items:
        if "root" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def run_kvtrace(*args, check=False, timeout=120, **kw) -> subprocess.CompletedProcess:
    """Run the kvtrace CLI as a user would, capturing output."""
    return subprocess.run([*KVTRACE, *args], capture_output=True, text=True, timeout=timeout, check=check, **kw)


@pytest.fixture
def kvtrace_cli():
    return run_kvtrace


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None


@pytest.fixture(scope="session")
def built_dist(tmp_path_factory):
    """(wheel, sdist) built once per session from a clean copy of the tree (tests/packaging.py)."""
    from tests.packaging import build_dist

    return build_dist(tmp_path_factory.mktemp("built_dist"))


@pytest.fixture(scope="session")
def wheel_venv(built_dist, tmp_path_factory):
    """A fresh venv (Debian's Python, --system-site-packages for bcc) with the built wheel
    installed, not editable, its dependencies from the index: the venv's directory."""
    from tests.packaging import install_wheel

    return install_wheel(built_dist[0], tmp_path_factory.mktemp("wheel_venv") / "venv")
