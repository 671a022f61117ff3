"""Stage the hook's files where one target can read them, confined to the target's own tree.

Each injection gets a directory of its own under the target's /tmp (reached through
``/proc/PID/root``, so a containerised server sees it at the same in-container path), made
exclusively with a random name, root's, mode 0755, every file written with
``O_CREAT|O_EXCL|O_NOFOLLOW`` (kvtrace.host.confined).  /tmp itself must be a real directory
(no link on the way) owned by root, by the target's user or by the container's root, and
sticky where others can write in it; otherwise the injection is refused in one line.  The
directory is removed when the injection ends: nothing stays on a shared path.

The files staged are those the hook module needs and no others (``hook_files``): its own and,
transitively, every kvtrace module it imports, read from their source, with the ``__init__.py``
of each package on the way.  vLLM's injection therefore carries none of SGLang's files, and the
other way round.

The target is never told to import a path: the loader (kvtrace.inject.loader) reads each
file, checks its SHA-256 against the digests the agent handed it in the injected code itself,
and runs modules only from the bytes it checked.  When the target runs the agent's Python
minor version, the files' bytecode is staged too (marshalled, digests likewise), so the import,
which holds the target's main thread, does not compile about 1,500 lines.
"""
from __future__ import annotations

import ast
import hashlib
import marshal
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import kvtrace
from kvtrace.host import confined

RESULT_DIR = "r"


def package_dir() -> Path:
    return Path(kvtrace.__file__).resolve().parent


def module_name(rel: str) -> str:
    return "kvtrace." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".") if rel != "__init__.py" \
        else "kvtrace"


def module_file(name: str) -> str | None:
    """The file of the kvtrace module ``name``, relative to the package directory, or None."""
    if name != "kvtrace" and not name.startswith("kvtrace."):
        return None
    base = name.removeprefix("kvtrace").lstrip(".").replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py") if base else ("__init__.py",):
        if (package_dir() / rel).is_file():
            return rel
    return None


def hook_files(module: str) -> list[str]:
    """The files to stage for the hook ``module`` (a server kind's ``hook_module``), relative to
    the package directory: its own, every kvtrace module it imports, transitively (relative and
    absolute imports, at module level, in a block or inside a function; not those under ``if
    TYPE_CHECKING:``), and the ``__init__.py`` of each package on the way.  ValueError names an
    import of kvtrace that is no module (the hook would not load)."""
    todo, found = [module], {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        rel = module_file(name)
        if rel is None:
            raise ValueError(f"{name} is not a module of kvtrace")
        found[name] = rel
        todo += [name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)]   # its packages
        todo += _imports(rel, name)
    return sorted(found.values())


def _imports(rel: str, name: str) -> list[str]:
    """The kvtrace modules one file imports: each ``import``'s name, each ``from X import a``'s X
    and X.a where that is a module (relative ones resolved against the file's package)."""
    tree = ast.parse((package_dir() / rel).read_bytes(), rel)
    typing_only = {id(inner) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for inner in ast.walk(stmt)}
    package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "kvtrace"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] == "kvtrace":
                out += [base] + [f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}")]
    return out


def target_uid(pid: int) -> int:
    """The target's effective uid, as this host numbers it."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        raise confined.UnsafePath(f"process {pid} exited or cannot be read") from None


@dataclass
class Staged:
    """One injection's directory in the target: ``inner`` as the target sees it."""
    inner: str
    tmp_fd: int
    name: str
    dir_fd: int
    result_fd: int
    files: dict = field(default_factory=dict)   # module name -> [path inside, sha256, is package, code path, sha256]

    def close(self) -> None:
        for fd in (self.result_fd, self.dir_fd):
            os.close(fd)
        confined.remove_tree(self.tmp_fd, self.name)
        os.close(self.tmp_fd)


def stage(pid: int, base: str = "/tmp", python: tuple[int, int] | None = None, root: str | None = None,
          *, module: str) -> Staged:
    """Copy the files of the hook ``module`` (hook_files) into a new ``<base>/kvtrace-<random>``
    in the target's tree; its results subdirectory belongs to the target's user (mode 0700), the
    rest to root.  ``python``: the target's (major, minor); the same as ours adds the bytecode."""
    files = hook_files(module)
    uid = target_uid(pid)
    with confined.Root(root or f"/proc/{pid}/root") as r:
        tmp_fd = r.opendir(base, owners={0, uid, r.uid})
    name = f"kvtrace-{secrets.token_hex(8)}"
    try:
        dir_fd = confined.mkdir_exclusive(tmp_fd, name, 0o755, f"{base}/{name}")
    except BaseException:
        os.close(tmp_fd)
        raise
    st = Staged(f"{base.rstrip('/')}/{name}", tmp_fd, name, dir_fd, -1)
    try:
        st.result_fd = confined.mkdir_exclusive(dir_fd, RESULT_DIR, 0o700, f"{st.inner}/{RESULT_DIR}")
        os.fchown(st.result_fd, uid, -1)
        _write_hook(st, files, python == tuple(sys.version_info[:2]))
    except BaseException:
        st.close()
        raise
    return st


def _write_hook(st: Staged, files: list[str], compile_too: bool) -> None:
    dirs: dict[str, int] = {"": st.dir_fd}
    try:
        for rel in files:
            parent = os.path.dirname(f"kvtrace/{rel}")
            fd = _subdir(st, dirs, parent)
            inner = f"{st.inner}/kvtrace/{rel}"
            src = (package_dir() / rel).read_bytes()
            confined.write_exclusive(fd, os.path.basename(rel), src, 0o644, shown=inner)
            entry = [inner, hashlib.sha256(src).hexdigest(), rel.endswith("__init__.py"), "", ""]
            if compile_too:
                code = marshal.dumps(compile(src, inner, "exec", dont_inherit=True))
                confined.write_exclusive(fd, os.path.basename(rel) + "c", code, 0o644, shown=inner + "c")
                entry[3:] = [inner + "c", hashlib.sha256(code).hexdigest()]
            st.files[module_name(rel)] = entry
    finally:
        for key, fd in dirs.items():
            if key:
                os.close(fd)


def _subdir(st: Staged, dirs: dict[str, int], key: str) -> int:
    """The directory ``key`` ("kvtrace", "kvtrace/hook", "kvtrace/hook/vllm") below the staged
    one, made by this staging the first time it is asked for."""
    if key not in dirs:
        parent = _subdir(st, dirs, os.path.dirname(key))
        dirs[key] = confined.mkdir_exclusive(parent, os.path.basename(key), 0o755, f"{st.inner}/{key}")
    return dirs[key]
