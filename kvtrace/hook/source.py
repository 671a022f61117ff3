"""A vLLM source tree read as files: modules parsed, classes found by name through the imports
that re-export them, base classes followed, nothing imported.  The hook's checks
(kvtrace.hook.plan) run on it in vLLM's interpreter before patching and, from the agent, on the
files of a server it found (through /proc/PID/root) or of a release that cannot run here.
Standard library only.
"""
from __future__ import annotations

import ast
import os

_FOLLOW = 6   # re-exports followed to find a class (vllm.x imports it from vllm.x.y ...)


class SourceTree:
    """The package (vLLM's, or SGLang's) under ``root`` (the directory that holds ``vllm/``)."""

    def __init__(self, root: str, package: str = "vllm"):
        self.root, self.package = root, package
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
            if os.path.isfile(p):
                return p
        return None

    def module(self, module: str) -> ast.Module | None:
        """The parsed module, or None when the tree has no such file (or it does not parse)."""
        if module not in self._mods:
            p = self.path(module)
            try:
                with open(p, "rb") as f:
                    st = os.fstat(f.fileno())
                    self._mods[module] = ast.parse(f.read(), p)
                self.files[os.path.relpath(p, self.root)] = [st.st_size, st.st_mtime_ns]
            except (TypeError, OSError, SyntaxError, ValueError):
                self._mods[module] = None
        return self._mods[module]

    def unchanged(self, files: dict[str, list[int]]) -> bool:
        """True when each of these files (as ``files`` recorded them) is still the same here."""
        try:
            for rel, (size, mtime) in files.items():
                st = os.stat(os.path.join(self.root, rel))
                if (st.st_size, st.st_mtime_ns) != (size, mtime):
                    return False
        except (OSError, TypeError, ValueError):
            return False
        return bool(files)

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
