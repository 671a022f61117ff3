"""A server's source tree (vLLM's, SGLang's) read as files: modules parsed, classes found by name
through the imports that re-export them, base classes followed, nothing imported.  The hook's
checks (kvtrace.hook.plan) run on it in the server's interpreter before patching and, from the
agent, on the files of a server it found (through /proc/PID/root) or of a release that cannot
run here.
Standard library only.

A tree under /proc/ (another process's files, seen from the agent: /proc/PID/root/…, or
/proc/self/fd/N of a directory the agent resolved inside that root) is read confined: no link
followed below the root (an absolute one would land in the agent's own tree), each file opened
without blocking and read only if it is a regular file of at most SOURCE_LIMIT bytes.  A file
that is not is raised as ``Unreadable``, naming it and why.
"""
from __future__ import annotations

import ast
import errno
import os
import stat

_FOLLOW = 6   # re-exports followed to find a class (vllm.x imports it from vllm.x.y ...)
SOURCE_LIMIT = 4 << 20   # bytes of one source file of another process's tree
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class Unreadable(Exception):
    """A file of a tree read confined that is not read: a link, a FIFO, a device, too large."""

    def __init__(self, rel: str, why: str):
        super().__init__(f"{rel}: not read, {why}")
        self.rel, self.why = rel, why


class SourceTree:
    """The package (vLLM's, or SGLang's) under ``root`` (the directory that holds ``vllm/``)."""

    def __init__(self, root: str, package: str = "vllm", confined: bool | None = None):
        self.root, self.package = root, package
        self.confined = root.startswith("/proc/") if confined is None else confined
        self._mods: dict[str, ast.Module | None] = {}
        self.files: dict[str, list[int]] = {}   # each file read: [size, mtime_ns], by path under root

    @classmethod
    def of_imported_vllm(cls) -> "SourceTree":
        """The tree of the vLLM this interpreter imports."""
        return cls.of_imported("vllm")

    @classmethod
    def of_imported(cls, package: str) -> "SourceTree":
        """The tree of the package this interpreter imports."""
        import importlib

        mod = importlib.import_module(package)
        return cls(os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__))), package)

    def path(self, module: str) -> str | None:
        base = os.path.join(self.root, *module.split("."))
        for p in (base + ".py", os.path.join(base, "__init__.py")):
            if self._isfile(p):
                return p
        return None

    def _isfile(self, p: str) -> bool:
        if not self.confined:
            return os.path.isfile(p)
        st = self._lstat(os.path.relpath(p, self.root))
        return st is not None and not stat.S_ISDIR(st.st_mode)   # a link or FIFO: refused when read

    def module(self, module: str) -> ast.Module | None:
        """The parsed module, or None when the tree has no such file (or it does not parse)."""
        if module not in self._mods:
            p = self.path(module)
            try:
                data, st = self._read(p)
                self._mods[module] = ast.parse(data, p)
                self.files[os.path.relpath(p, self.root)] = [st.st_size, st.st_mtime_ns]
            except (TypeError, OSError, SyntaxError, ValueError):
                self._mods[module] = None
        return self._mods[module]

    def unchanged(self, files: dict[str, list[int]]) -> bool:
        """True when each of these files (as ``files`` recorded them) is still the same here."""
        try:
            for rel, (size, mtime) in files.items():
                st = self._lstat(rel) if self.confined else os.stat(os.path.join(self.root, rel))
                if st is None or not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (size, mtime):
                    return False
        except (OSError, TypeError, ValueError, Unreadable):
            return False
        return bool(files)

    # -- reading, confined under /proc/ ----------------------------------------------------------

    def _read(self, p: str) -> tuple[bytes, os.stat_result]:
        if not self.confined:
            with open(p, "rb") as f:
                return f.read(), os.fstat(f.fileno())
        rel = os.path.relpath(p, self.root)
        dfd, name = self._parent(rel)
        try:
            fd = os.open(name, _READ, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Unreadable(rel, "it is a symbolic link (not followed)") from None
            raise
        finally:
            os.close(dfd)
        try:
            return _regular(fd, rel), os.fstat(fd)
        finally:
            os.close(fd)

    def _parent(self, rel: str) -> tuple[int, str]:
        """(fd of rel's directory, its last name), reached from the root through no link."""
        *dirs, name = [p for p in rel.split("/") if p not in ("", ".")] or [""]
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for d in dirs:
                if d == "..":
                    raise Unreadable(rel, "it leads out of the tree")
                try:
                    nxt = os.open(d, _DIR, dir_fd=fd)
                except NotADirectoryError:
                    if stat.S_ISLNK(os.stat(d, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise Unreadable(rel, f"{d} is a symbolic link (not followed)") from None
                    raise
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def _lstat(self, rel: str) -> os.stat_result | None:
        """The file itself (a link not followed), or None when it is not there."""
        try:
            fd, name = self._parent(rel)
        except OSError:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(fd)

    def version(self) -> str | None:
        """PACKAGE/_version.py's __version__ (or version), as the wheel wrote it."""
        tree = self.module(self.package + "._version")
        for node in getattr(tree, "body", ()):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in ("__version__", "version") and isinstance(node.value, ast.Constant):
                    return str(node.value.value)
        return None

    # -- names ---------------------------------------------------------------------------------

    def top_level(self, module: str) -> dict[str, ast.AST]:
        """Names a module defines or imports at its top level (not under ``if TYPE_CHECKING``)."""
        out: dict[str, ast.AST] = {}
        for node in _runtime_body(getattr(self.module(module), "body", [])):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out[n.id] = node
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = node
        return out

    def resolve(self, module: str, name: str) -> tuple[str, ast.AST] | None:
        """(module, node) defining ``name`` as seen from ``module``, following ``from x import``."""
        for _ in range(_FOLLOW):
            node = self.top_level(module).get(name)
            if not isinstance(node, ast.ImportFrom):
                return None if node is None else (module, node)
            src = _absolute(module, node, self.path(module))
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            if self.path(src) is None:
                return None   # outside this tree (typing, torch, ...)
            module, name = src, alias.name
        return None

    def find_class(self, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
        found = self.resolve(module, name)
        return found if found and isinstance(found[1], ast.ClassDef) else None

    def mro(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases found in this tree, the class first (depth first)."""
        first = self.find_class(module, name)
        out, todo = [], [first] if first else []
        while todo:
            mod, cls = todo.pop(0)
            if any(c is cls for _, c in out):
                continue
            out.append((mod, cls))
            for b in cls.bases:
                base = self._base(mod, b)
                if base:
                    todo.append(base)
        return out

    def _base(self, module: str, expr: ast.expr) -> tuple[str, ast.ClassDef] | None:
        if isinstance(expr, ast.Subscript):   # Generic[T], Base[X]
            expr = expr.value
        if isinstance(expr, ast.Name):
            return self.find_class(module, expr.id)
        return None

    def definition(self, module: str, qualname: str) -> ast.AST | None:
        """A module-level function or class, or ``Class.method`` defined on that class itself."""
        head, _, attr = qualname.rpartition(".")
        if not head:
            found = self.resolve(module, attr)
            node = found[1] if found else None
            return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
        cls = self.find_class(module, head)
        return own_method(cls[1], attr) if cls else None


def _regular(fd: int, rel: str) -> bytes:
    """The bytes of an open file if it is a regular file of at most SOURCE_LIMIT bytes."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise Unreadable(rel, "it is not a regular file")
    out = bytearray()
    while len(out) <= SOURCE_LIMIT:
        b = os.read(fd, min(1 << 20, SOURCE_LIMIT + 1 - len(out)))
        if not b:
            return bytes(out)
        out += b
    raise Unreadable(rel, f"it is larger than {SOURCE_LIMIT} bytes")


def own_method(cls: ast.ClassDef, name: str):
    """The last definition of ``name`` in the class body (a property setter counts too)."""
    found = None
    for node in _runtime_body(cls.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = node
    return found


def _runtime_body(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a body, with those of ``if``/``try`` blocks in it (not ``if TYPE_CHECKING``)."""
    out = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                out += _runtime_body(node.body) + _runtime_body(node.orelse)
        elif isinstance(node, ast.Try):
            out += _runtime_body(node.body) + _runtime_body(node.orelse) + _runtime_body(node.finalbody)
            for h in node.handlers:
                out += _runtime_body(h.body)
        else:
            out.append(node)
    return out


def _absolute(module: str, node: ast.ImportFrom, path: str | None) -> str:
    if not node.level:
        return node.module or ""
    package = module if path and path.endswith("__init__.py") else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package
