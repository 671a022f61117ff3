"""Staging the hook for injection, confined to the target's tree: a new directory of its own
for each injection, root's, made exclusively and removed at the end; the target runs only
bytes whose digests the agent sent in the injected code (the loader's included), so a file
planted or changed on the shared path never runs; the base directory is refused when reached
through a link or when others can swap things in it.  No ptrace here: the loader is run by a
child interpreter, as the injected one-liner runs it (tests/privileged/test_hostile.py does it
by ptrace into live processes)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from kvtrace.host import confined
from kvtrace.inject import loader, stage
from kvtrace.servers import registry
from tests.helpers import tree_state

PY = "/usr/bin/python3"
VLLM, SGLANG = registry.kind("vllm").hook_module, registry.kind("sglang").hook_module


def _run_loader(st: stage.Staged, action: str = "install", name: str = "loader.py",
                module: str = VLLM) -> tuple[dict | None, str]:
    """Write the loader as the injector does and run the injected line in a child; (its report, the
    child's kvtrace modules)."""
    code = loader.render(st.files, f"{st.inner}/r/{name}.json", action, module=module).encode()
    confined.write_exclusive(st.dir_fd, name, code)
    line = loader.bootstrap(f"{st.inner}/{name}", code)
    p = subprocess.run([PY, "-c", line + "\nimport sys; print(sorted(m for m in sys.modules if 'kvtrace' in m))"],
                       capture_output=True, text=True, cwd="/", timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    path = f"{st.inner}/r/{name}.json"
    return (json.load(open(path)) if os.path.exists(path) else None), p.stdout


def _same_minor() -> bool:
    return subprocess.run([PY, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True).stdout.strip() == str(tuple(sys.version_info[:2]))


def test_a_new_private_directory_for_each_injection_removed_at_the_end(tmp_path):
    a, b = stage.stage(os.getpid(), base=str(tmp_path), module=VLLM), stage.stage(os.getpid(), base=str(tmp_path), module=VLLM)
    try:
        assert a.inner != b.inner and os.path.basename(a.inner).startswith("kvtrace-")
        st = os.stat(a.inner)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o755)
        r = os.stat(f"{a.inner}/r")
        assert (r.st_uid, stat.S_IMODE(r.st_mode)) == (os.getuid(), 0o700)
        for entry in a.files.values():
            assert stat.S_IMODE(os.stat(entry[0]).st_mode) == 0o644
    finally:
        a.close()
        b.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not _same_minor(), reason="/usr/bin/python3 is not the agent's Python minor version")
def test_the_target_runs_the_checked_bytecode(tmp_path):
    st = stage.stage(os.getpid(), base=str(tmp_path), python=sys.version_info[:2], module=VLLM)
    try:
        assert all(e[3].endswith(".pyc") and os.path.isfile(e[3]) for e in st.files.values())
        os.unlink(st.files["kvtrace.hook.wire"][0])    # the source is not what runs: the checked bytecode is
        rep, mods = _run_loader(st)
    finally:
        st.close()
    assert "error" not in rep, rep
    assert rep["hook_file"] == f"{st.inner}/kvtrace/hook/vllm/hook.py"
    assert "'kvtrace.hook.wire'" in mods and "'kvtrace.hook.vllm.hook'" in mods and "sglang" not in mods


def test_sglang_s_hook_runs_from_its_own_staged_files_alone(tmp_path):
    """SGLang's injection stages SGLang's hook and the shared parts, none of vLLM's, and the
    hook loads from them (install then finds no SGLang in this interpreter and says so)."""
    st = stage.stage(os.getpid(), base=str(tmp_path), module=SGLANG)
    try:
        assert not [m for m in st.files if m.startswith("kvtrace.hook.vllm")], sorted(st.files)
        rep, mods = _run_loader(st, module=SGLANG)
    finally:
        st.close()
    assert "error" not in rep and rep["installed"] is False, rep
    assert rep["status"]["reason"].startswith("install failed: ModuleNotFoundError"), rep["status"]
    assert rep["hook_file"] == f"{st.inner}/kvtrace/hook/sglang/hook.py"
    assert "'kvtrace.hook.sglang.hook'" in mods and "vllm" not in mods


def test_other_python_target_gets_sources_only(tmp_path):
    st = stage.stage(os.getpid(), base=str(tmp_path), python=(3, sys.version_info[1] + 1), module=VLLM)
    try:
        assert not [e for e in st.files.values() if e[3]]
        assert not [f for _, _, fs in os.walk(st.inner) for f in fs if f.endswith(".pyc")]
        rep, mods = _run_loader(st, "status")
    finally:
        st.close()
    assert rep["status"]["reason"] == "no kvtrace hook in this process" and mods.strip() == "[]"


@pytest.mark.parametrize("victim", ["kvtrace.hook.state", "kvtrace"])
def test_a_changed_staged_file_never_runs(tmp_path, victim):
    marker = tmp_path / "ran"
    (tmp_path / "base").mkdir()
    st = stage.stage(os.getpid(), base=str(tmp_path / "base"), module=VLLM)
    try:
        path = st.files[victim][3] or st.files[victim][0]
        os.chmod(path, 0o644)
        with open(path, "w") as f:   # what an attacker who could write there would put
            f.write(f"open({str(marker)!r}, 'w').write('planted')\n")
        rep, mods = _run_loader(st)
    finally:
        st.close()
    assert not marker.exists()
    assert rep["error"] == f"ImportError: the staged file {path} is not the one kvtrace wrote"
    assert mods.strip() == "[]"


def test_a_changed_loader_never_runs(tmp_path):
    marker = tmp_path / "ran"
    st = stage.stage(os.getpid(), base=str(tmp_path), module=VLLM)
    try:
        code = loader.render(st.files, f"{st.inner}/r/x.json", "install", module=VLLM).encode()
        confined.write_exclusive(st.dir_fd, "loader.py", f"open({str(marker)!r}, 'w')\n".encode())
        p = subprocess.run([PY, "-c", loader.bootstrap(f"{st.inner}/loader.py", code)], capture_output=True,
                           text=True, cwd="/", timeout=60)
    finally:
        st.close()
    assert p.returncode == 0 and not marker.exists()


def test_a_planted_directory_of_the_old_predictable_name_is_never_imported(tmp_path):
    """Earlier kvtrace staged to /tmp/kvtrace-hook-VERSION-DIGEST and used it if it existed."""
    marker = tmp_path / "ran"
    base = tmp_path / "tmp"
    base.mkdir(mode=0o1777)
    os.chmod(base, 0o1777)
    planted = base / "kvtrace-hook-0.1.0-000000000000" / "kvtrace"
    (planted / "hook").mkdir(parents=True)
    for rel in stage.hook_files(VLLM):
        (planted / rel).parent.mkdir(parents=True, exist_ok=True)
        (planted / rel).write_text(f"open({str(marker)!r}, 'w').write('planted')\n")
    st = stage.stage(os.getpid(), base=str(base), module=VLLM)
    try:
        rep, _ = _run_loader(st)
    finally:
        st.close()
    assert "error" not in rep and not marker.exists()
    assert sorted(os.listdir(base)) == ["kvtrace-hook-0.1.0-000000000000"]


def test_a_base_reached_through_a_link_is_refused_and_the_host_left_alone(tmp_path):
    """A container whose /tmp links out: through /proc/PID/root an absolute link would land in
    the host's tree; resolved in the container's root with no link followed, it is refused."""
    host_dir = tmp_path / "host-secret"
    host_dir.mkdir(mode=0o700)
    (host_dir / "keep").write_text("root only\n")
    root = tmp_path / "ctr"
    root.mkdir()
    (root / "tmp").symlink_to(str(host_dir))
    before = tree_state(host_dir)
    with pytest.raises(confined.UnsafePath, match=rf"^{root}/tmp: not used, it is, or passes through, a symbolic link$"):
        stage.stage(os.getpid(), base="/tmp", root=str(root), module=VLLM)
    assert tree_state(host_dir) == before


def test_a_link_on_the_way_is_refused(tmp_path):
    host_dir = tmp_path / "host"
    (host_dir / "tmp").mkdir(parents=True, mode=0o1777)
    root = tmp_path / "ctr"
    root.mkdir()
    (root / "var").symlink_to(str(host_dir))
    with pytest.raises(confined.UnsafePath, match=rf"^{root}/var/tmp: not used, it is, or passes through, a symbolic link$"):
        stage.stage(os.getpid(), base="/var/tmp", root=str(root), module=VLLM)
    assert os.listdir(host_dir / "tmp") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
@pytest.mark.parametrize("mode,owner,ok", [(0o1777, 0, True), (0o777, 0, False), (0o755, 12345, False),
                                           (0o1777, 12345, False), (0o700, "target", True)])
def test_the_base_must_be_safe_from_other_users(tmp_path, mode, owner, ok):
    base = tmp_path / "tmp"
    base.mkdir()
    os.chown(base, os.getuid() if owner == "target" else owner, -1)
    os.chmod(base, mode)
    if ok:
        stage.stage(os.getpid(), base=str(base), module=VLLM).close()
        assert os.listdir(base) == []
    else:
        with pytest.raises(confined.UnsafePath, match=rf"^/proc/{os.getpid()}/root{base}: not used, "):
            stage.stage(os.getpid(), base=str(base), module=VLLM)


def test_the_walk_without_openat2_refuses_links_and_dotdot(tmp_path, monkeypatch):
    monkeypatch.setattr(confined, "_openat2_ok", False)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with confined.Root(str(tmp_path)) as r:
        os.close(r.opendir("/real"))
        with pytest.raises(confined.UnsafePath, match="symbolic link"):
            r.opendir("/link")
        with pytest.raises(confined.UnsafePath, match="leads out"):
            r.opendir("/real/..")
    assert confined._openat2_ok is False


def _hook_imports(rel: str) -> set[str]:
    """The kvtrace modules one hook file imports (relative and absolute, anywhere in the file but
    under ``if TYPE_CHECKING:``), read here independently of kvtrace.inject.stage."""
    import ast

    tree = ast.parse((stage.package_dir() / rel).read_text())
    pkg = stage.module_name(rel) if rel.endswith("__init__.py") else stage.module_name(rel).rsplit(".", 1)[0]
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            typing_only |= {id(n) for b in node.body for n in ast.walk(b)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("kvtrace"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvtrace"))
    return {m for m in out if _module_file(m)}


def _module_file(m: str) -> str | None:
    base = m.removeprefix("kvtrace").lstrip(".").replace(".", "/")
    for rel in ([base + ".py", base + "/__init__.py"] if base else ["__init__.py"]):
        if (stage.package_dir() / rel).is_file():
            return rel
    return None


def _closure(module: str) -> set[str]:
    """The files a hook module needs: its own, those of what it imports, transitively, and of
    every package on the way."""
    want, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in want:
            continue
        want.add(m)
        rel = _module_file(m)
        assert rel is not None, f"{m} is imported by the hook but is not a module"
        todo.extend(_hook_imports(rel) - want)
        todo.extend(".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1))
    return {_module_file(m) for m in want}


@pytest.mark.parametrize("kind", registry.names())
def test_the_staged_files_are_exactly_what_the_hooks_import(kind):
    """Staged for a kind: the closure of its hook module's kvtrace imports, no more, no less; and
    none of another kind's hook package."""
    module = registry.kind(kind).hook_module
    staged = set(stage.hook_files(module))
    want = _closure(module)
    assert staged == want, (f"staged but not imported: {sorted(staged - want)}; "
                            f"imported but not staged: {sorted(want - staged)}")
    others = {f"hook/{k}/" for k in registry.names() if k != kind}
    assert not [f for f in staged if f.startswith(tuple(others))], sorted(staged)
    assert f"hook/{kind}/hook.py" in staged and "hook/state.py" in staged
