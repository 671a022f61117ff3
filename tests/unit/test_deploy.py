"""deploy/: the DaemonSet validates against the Kubernetes schemas offline, grants exactly the
agent's least capabilities (kvtrace.host.privileges.AGENT_LEAST, the one list), mounts what the
agent reads, and runs options kvtrace's attach has; the systemd unit grants the same set, runs
options attach has, and passes `systemd-analyze verify`."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtrace.commands import attach
from kvtrace.host import privileges

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
UNIT = DEPLOY / "systemd" / "kvtrace.service"
HOST_MOUNTS = ("/sys/kernel/tracing", "/lib/modules", "/usr/src")   # tracefs, and the headers bcc compiles against


def manifest() -> list[dict]:
    return [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]


def pod_spec() -> dict:
    (ds,) = [d for d in manifest() if d["kind"] == "DaemonSet"]
    return ds["spec"]["template"]["spec"]


def agent() -> dict:
    (c,) = pod_spec()["containers"]
    return c


def parse_attach(args: list[str]) -> dict:
    """attach's own parser on these arguments (a missing or misspelt option raises)."""
    assert args[0] == "attach", args
    return attach.command.make_context("attach", list(args[1:])).params


def test_manifest_validates_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (pip install -e '.[test]')")
    docs = manifest()
    assert [d["kind"] for d in docs] == ["ServiceAccount", "DaemonSet"]
    for version in ("1.30.0", kv.latest_version()):   # appArmorProfile is in the schema from 1.30
        for doc in docs:
            kv.validate(doc, version, strict=True)
            assert "namespace" not in doc["metadata"]


def test_daemonset_adds_exactly_the_agents_least_capabilities():
    sc = agent()["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert [f"CAP_{c}" for c in sc["capabilities"]["add"]] == list(privileges.AGENT_LEAST)
    assert sc["privileged"] is False and sc["runAsUser"] == 0
    assert "allowPrivilegeEscalation" not in sc   # false is refused together with an added SYS_ADMIN


def test_daemonset_shares_the_hosts_pids_and_mounts_what_the_agent_reads():
    spec, c = pod_spec(), agent()
    assert spec["hostPID"] is True and spec["hostNetwork"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in HOST_MOUNTS:
        assert mounts[path]["readOnly"] is True and volumes[mounts[path]["name"]]["hostPath"]["path"] == path
    host_paths = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    assert "/proc" not in host_paths   # hostPID: the container's own /proc lists the host's processes
    out = parse_attach(expanded_args(c))["out"]
    (data,) = [m for m in c["volumeMounts"] if m["name"] == "data"]
    assert out.startswith(data["mountPath"] + "/") and not data.get("readOnly")


def expanded_args(c: dict) -> list[str]:
    """The container's args with $(VAR) replaced as the kubelet does, from its env values."""
    env = {e["name"]: e.get("value") for e in c["env"]}
    names = {n for a in c["args"] for n in re.findall(r"\$\((\w+)\)", a)}
    assert names <= env.keys(), names - env.keys()
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]


def test_daemonset_args_are_attach_options():
    c = agent()
    assert "command" not in c   # the image's entrypoint is `kvtrace`
    params = parse_attach(expanded_args(c))
    assert params["yes"] and params["on_restart"] == "follow" and params["quiet"]
    assert params["otlp"].startswith("http://") and params["otlp_protocol"] == "http"
    assert not params["pids"] and not params["command"]


def unit() -> dict[str, dict[str, list[str]]]:
    """The unit's sections as {section: {key: [values, in order]}} (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key, []).append(value)
    return out


def test_unit_grants_exactly_the_agents_least_capabilities():
    service = unit()["Service"]
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        (value,) = service[key]
        assert value.split() == list(privileges.AGENT_LEAST), key
    assert service["User"] == ["root"] and service["NoNewPrivileges"] == ["yes"]


def unit_environment(service: dict) -> dict[str, str]:
    env = {"STATE_DIRECTORY": f"/var/lib/{service['StateDirectory'][0]}"}
    for value in service.get("Environment", []):
        env.update(item.split("=", 1) for item in shlex.split(value))
    return env


def test_unit_execstart_is_an_attach_that_stops_cleanly():
    service = unit()["Service"]
    (exec_start,) = service["ExecStart"]
    env = unit_environment(service)
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in shlex.split(exec_start)]
    assert argv[0].endswith("/kvtrace")
    params = parse_attach(argv[1:])
    assert params["yes"] and params["on_restart"] == "follow"
    assert params["out"].startswith("/var/lib/kvtrace/") and params["otlp"] == ""   # "": no OTLP
    assert service["KillSignal"] == ["SIGTERM"] and service["KillMode"] == ["mixed"]
    assert service["Restart"] == ["on-failure"] and unit()["Unit"]["StartLimitIntervalSec"] == ["0"]


def test_systemd_analyze_verify(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    kvtrace = Path(sys.executable).parent / "kvtrace"
    if not kvtrace.exists():
        pytest.skip(f"no kvtrace console script beside {sys.executable}: verify checks that ExecStart exists")
    # the unit names /opt/kvtrace/bin/kvtrace; verify insists the binary exists, so point it here
    copy = tmp_path / "kvtrace.service"
    copy.write_text(UNIT.read_text().replace("/opt/kvtrace/bin/kvtrace", str(kvtrace)))
    p = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr
