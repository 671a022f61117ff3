"""A hostile host, with real processes: another user plants the hook's old staging name in
/tmp, and a container (a mount namespace chrooted into a tree of its own) links its /tmp and
/dev/shm out to root-only host directories.  Live injection by ptrace must run no planted code,
write and chmod nothing outside the target's own tree, and refuse in one line where it cannot
stay inside; every host file stays byte-identical, with its mode and owner."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvtrace.attach.agentflag import AgentFlag
from kvtrace.errors import TargetError
from kvtrace.host.confined import UnsafePath
from kvtrace.inject import injector, stage
from kvtrace.servers import registry

VLLM_HOOK = registry.kind("vllm").hook_module
from tests.helpers import tree_state

pytestmark = pytest.mark.root

SLEEPER = "import time\nwhile True: time.sleep(0.05)\n"
ATTACKER = 12345


def _as(uid: int):
    def drop():
        os.setgid(uid)
        os.setuid(uid)
    return drop


def _started(argv: list[str], **kw) -> subprocess.Popen:
    p = subprocess.Popen(argv, **kw)
    time.sleep(1.5)
    assert p.poll() is None
    return p


def _old_name() -> str:
    """The predictable directory earlier kvtrace staged to and used when it existed."""
    h = hashlib.sha256()
    for rel in stage.hook_files(VLLM_HOOK):
        h.update((stage.package_dir() / rel).read_bytes())
    return f"kvtrace-hook-0.1.0-{h.hexdigest()[:12]}"


@pytest.fixture
def planted(tmp_path):
    """The old staging name in the host's /tmp, made first by another user, whose every hook
    file writes a marker."""
    marker = tmp_path / "planted-ran"
    os.chmod(tmp_path, 0o777)
    d = Path("/tmp") / _old_name()
    if d.exists():
        shutil.rmtree(d)
    code = f"open({str(marker)!r}, 'w').write('planted')\n"
    script = ("import os, sys\nd, code = sys.argv[1], sys.argv[2]\n"
              f"for rel in {stage.hook_files(VLLM_HOOK)!r}:\n"
              "    p = os.path.join(d, 'kvtrace', rel)\n    os.makedirs(os.path.dirname(p), exist_ok=True)\n"
              "    open(p, 'w').write(code)\n")
    subprocess.run(["/usr/bin/python3", "-c", script, str(d), code], check=True, preexec_fn=_as(ATTACKER))
    before = tree_state(d)
    yield marker, d, before
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("server_uid", [65534, 0])
def test_a_planted_staging_directory_never_runs_in_the_server(planted, server_uid):
    marker, d, before = planted
    p = _started(["/usr/bin/python3", "-c", SLEEPER], preexec_fn=_as(server_uid) if server_uid else None, cwd="/")
    try:
        rep = injector.hook(p.pid, "install", timeout=20, module=VLLM_HOOK)
    finally:
        p.kill()
        p.wait()
    assert "error" not in rep, rep
    assert rep["status"]["reason"] == f"no role in process 'MainProcess'"   # the real hook ran and judged the process
    assert rep["hook_file"].startswith("/tmp/kvtrace-") and not rep["hook_file"].startswith(str(d))
    assert not os.path.exists(os.path.dirname(os.path.dirname(os.path.dirname(rep["hook_file"]))))   # removed
    assert not marker.exists() and tree_state(d) == before


@pytest.fixture
def container(tmp_path):
    """A process in a mount namespace of its own, chrooted into a tree whose /tmp and /dev/shm
    are links to root-only host directories (what a container's image can hold)."""
    victims = []
    for name in ("host-tmp", "host-shm"):
        v = tmp_path / name
        v.mkdir()
        os.chmod(v, 0o700)
        (v / "keep").write_text("root only\n")
        os.chmod(v / "keep", 0o600)
        victims.append(v)
    root = tmp_path / "ctr"
    (root / "usr").mkdir(parents=True)
    (root / "dev").mkdir()
    for link in ("bin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    (root / "tmp").symlink_to(victims[0])
    (root / "dev" / "shm").symlink_to(victims[1])
    inner = f"mount --bind -o ro /usr {root}/usr && exec chroot {root} /usr/bin/python3 -c '{SLEEPER}'"
    p = _started(["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", inner])
    pid = _child(p.pid)
    before = [tree_state(v) for v in victims]
    yield pid, victims, before
    _end(p, pid)


def _end(p: subprocess.Popen, pid: int) -> None:
    """The chrooted process first: killing unshare alone would leave it running."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    p.kill()
    p.wait()


def _child(pid: int) -> int:
    """The chrooted Python under unshare (and its sh, which execs it)."""
    for _ in range(50):
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids and os.readlink(f"/proc/{kids[0]}/root") != "/":
            return int(kids[0])
        time.sleep(0.1)
    raise AssertionError("the container process did not start")


def test_a_container_linking_tmp_out_is_refused_in_one_line(container):
    pid, victims, before = container
    with pytest.raises(TargetError) as e:
        injector.hook(pid, "install", timeout=20, module=VLLM_HOOK)
    assert str(e.value) == (f"process {pid}: the hook is not staged: /proc/{pid}/root/tmp: not used, "
                            "it is, or passes through, a symbolic link")
    assert [tree_state(v) for v in victims] == before


def test_a_container_linking_dev_shm_out_gets_no_flag(container, tmp_path):
    pid, victims, before = container
    (tmp_path / "shm").mkdir()
    with AgentFlag(str(tmp_path / "shm" / "kvtrace-agents")) as flag:
        flag.dir = "/dev/shm/kvtrace-agents"
        with pytest.raises(UnsafePath, match=rf"^/proc/{pid}/root/dev/shm: not used, it is, or passes through, a symbolic link$"):
            flag.add_root(f"/proc/{pid}/root")
    assert [tree_state(v) for v in victims] == before
    assert oct(os.stat(victims[1]).st_mode & 0o777) == "0o700"


def test_a_container_with_its_own_tmp_gets_the_hook_and_keeps_nothing(tmp_path):
    root = tmp_path / "ctr"
    (root / "usr").mkdir(parents=True)
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    for link in ("bin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    inner = f"mount --bind -o ro /usr {root}/usr && exec chroot {root} /usr/bin/python3 -c '{SLEEPER}'"
    p = _started(["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", inner])
    pid = _child(p.pid)
    try:
        rep = injector.hook(pid, "install", timeout=20, module=VLLM_HOOK)
        assert "error" not in rep and rep["hook_file"].startswith("/tmp/kvtrace-"), rep
        assert rep["status"]["reason"] == "no role in process 'MainProcess'"
        assert os.listdir(root / "tmp") == []
    finally:
        _end(p, pid)
