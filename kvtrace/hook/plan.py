"""The kinds of thing the hook needs of a server (vLLM, SGLang), each with its check: a method
it wraps, the fields and attributes it reads, a name a module defines, the calls by which the
server drives what the hook times.  What is needed is listed in each kind's ``needs`` module
(kvtrace.hook.vllm.needs, kvtrace.hook.sglang.needs); this module says how each kind of target
is checked.

Every check reads the server's source files (kvtrace.hook.source), so the same verdict comes out
in the server's interpreter before patching, in the agent for a server it found, and in CI for a
release that cannot run here.  In the server's interpreter a wrapped method is also checked on
the imported class (``live``), because the wrapper is generated from that function's own
signature.

A check returns None, or what differs in a few words ("parameter 'request' missing").
Standard library only.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass

from .source import SourceTree, own_method


@dataclass(frozen=True)
class Method:
    """A method the hook wraps.  ``params``: its leading parameters, by name and place (what the
    wrapper reads).  ``plain``: the wrapper spells out every parameter (no positional-only,
    keyword-only or variadic one); else any may follow: the wrappers of those take them through ``*args, **kwargs``).
    Parameters after the leading ones are handed on untouched, required or not.  ``kind``: "function" on the class itself, or "classmethod"."""

    module: str
    cls: str
    name: str
    params: tuple[str, ...]
    plain: bool = True
    kind: str = "function"
    own: bool = True   # defined on the class itself (else inherited is fine)
    reads: tuple[str, ...] = ()   # further parameters the wrapper reads by name, wherever they are

    @property
    def label(self) -> str:
        return f"{self.cls}.{self.name}"

    def check(self, src: SourceTree) -> str | None:
        chain = src.mro(self.module, self.cls)
        if not chain:
            return _no_class(src, self.module)
        for _, cls in chain[:1] if self.own else chain:
            node = own_method(cls, self.name)
            if node is not None:
                return self._node_differs(node)
        return "missing"

    def _node_differs(self, node: ast.FunctionDef) -> str | None:
        decorators = {ast.unparse(d) for d in node.decorator_list}
        if self.kind == "classmethod" and "classmethod" not in decorators:
            return "is not a classmethod"
        if self.kind == "function" and decorators & {"classmethod", "staticmethod", "property"}:
            return f"is a {sorted(decorators & {'classmethod', 'staticmethod', 'property'})[0]}"
        a = node.args
        names = [p.arg for p in a.posonlyargs + a.args]
        odd = ([f"positional-only parameter {p.arg!r}" for p in a.posonlyargs]
               + [f"keyword-only parameter {p.arg!r}" for p in a.kwonlyargs]
               + [f"variadic parameter {v.arg!r}" for v in (a.vararg, a.kwarg) if v is not None])
        return self._params_differ(names + [p.arg for p in a.kwonlyargs], odd)

    def _params_differ(self, names: list[str], odd: list[str]) -> str | None:
        want = list(self.params)
        gone = [r for r in self.reads if r not in names]
        if gone:
            return f"parameter {gone[0]!r} missing (takes {', '.join(names)})"
        if names[:len(want)] != want:
            gone = [w for w in want if w not in names]
            if gone:
                return f"parameter {gone[0]!r} missing (takes {', '.join(names)})"
            return f"takes ({', '.join(names)}), expected ({', '.join(want)}, ...)"
        if self.plain and odd:
            return f"has a {odd[0]}"
        return None

    def live(self) -> str | None:
        """The same check on the imported class (this interpreter's vLLM), as the wrapper sees it."""
        cls = getattr(importlib.import_module(self.module), self.cls)
        raw = _original(cls, self.name) if self.own else getattr(cls, self.name, None)
        if raw is None:
            return "missing"
        if self.kind == "classmethod":
            if not isinstance(raw, classmethod):
                return "is not a classmethod"
            raw = raw.__func__
        elif isinstance(raw, (classmethod, staticmethod, property)):
            return f"is a {type(raw).__name__}"
        try:
            params = list(inspect.signature(raw, follow_wrapped=False).parameters.values())
        except (TypeError, ValueError) as e:
            return f"has no readable signature ({e})"
        P = inspect.Parameter
        odd = [f"{p.kind.description} parameter {p.name!r}" for p in params if p.kind is not P.POSITIONAL_OR_KEYWORD]
        return self._params_differ([p.name for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)], odd)


@dataclass(frozen=True)
class Fields:
    """Fields of a vLLM dataclass that the hook reads."""

    module: str
    cls: str
    names: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.cls

    def check(self, src: SourceTree) -> str | None:
        chain = src.mro(self.module, self.cls)
        if not chain:
            return _no_class(src, self.module)
        have = {n for _, c in chain for n in _class_fields(c)}
        gone = [n for n in self.names if n not in have]
        return f"field {gone[0]!r} missing" if gone else None


@dataclass(frozen=True)
class Attrs:
    """Attributes the hook reads off vLLM's objects: set on ``self`` in a method, defined in the
    class body (a field, a method, a property) or named in ``__slots__``, here or in a base."""

    module: str
    cls: str
    names: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.cls

    def check(self, src: SourceTree) -> str | None:
        chain = src.mro(self.module, self.cls)
        if not chain:
            return _no_class(src, self.module)
        have = set()
        for _, c in chain:
            have |= _class_attrs(c)
        gone = [n for n in self.names if n not in have]
        return f"attribute {gone[0]!r} missing" if gone else None


@dataclass(frozen=True)
class Globals:
    """Names a vLLM module defines (or imports) at its top level."""

    module: str
    names: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.module

    def check(self, src: SourceTree) -> str | None:
        if src.module(self.module) is None:
            return "module missing"
        have = src.top_level(self.module)
        gone = [n for n in self.names if n not in have]
        return f"{gone[0]!r} missing" if gone else None


@dataclass(frozen=True)
class Calls:
    """A vLLM function that calls these methods, in this order (first call of each): how vLLM
    drives what the hook times.  A class instead of a function: its methods call each of them,
    in any order.  ``optional``: it may be absent, but where it is there, it must still call
    them."""

    module: str
    qualname: str
    names: tuple[str, ...]
    optional: bool = False

    @property
    def label(self) -> str:
        return self.qualname

    def check(self, src: SourceTree) -> str | None:
        node = src.definition(self.module, self.qualname)
        if node is None:
            return None if self.optional else ("missing" if src.module(self.module) else "module missing")
        order = _call_order(node)
        gone = [n for n in self.names if n not in order]
        if gone:
            return f"no longer calls {gone[0]}()"
        if isinstance(node, ast.ClassDef):
            return None
        pos = [order.index(n) for n in self.names]
        for i in range(1, len(pos)):
            if pos[i] < pos[i - 1]:
                return f"calls {self.names[i]}() before {self.names[i - 1]}()"
        return None


@dataclass(frozen=True)
class Strings:
    """String constants a vLLM module uses (an f-string counts by its literal start): the
    process names by which the hook finds its role."""

    module: str
    values: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.module

    def check(self, src: SourceTree) -> str | None:
        tree = src.module(self.module)
        if tree is None:
            return "module missing"
        have = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                have.add(node.value)
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                have.add(node.values[0].value)
        gone = [v for v in self.values if v not in have]
        return f"no longer names {gone[0]!r}" if gone else None


# ---------------------------------------------------------------------------------------------


def first_difference(targets, src: SourceTree, live: bool = False) -> tuple[object, str] | None:
    """The first target that differs and what differs, or None when every one is as needed."""
    for t in targets:
        why = t.check(src)
        if why is None and live and isinstance(t, Method):
            why = t.live()
        if why is not None:
            return t, why
    return None


def differences(targets, src: SourceTree, live: bool = False) -> list[str]:
    """Every target that differs, as "label: what differs"."""
    out = []
    for t in targets:
        why = t.check(src)
        if why is None and live and isinstance(t, Method):
            why = t.live()
        if why is not None:
            out.append(f"{t.label}: {why}")
    return out


def _no_class(src: SourceTree, module: str) -> str:
    return "module missing" if src.module(module) is None else "class missing"


def _original(cls, attr):
    """What the class's own attribute is, under a kvtrace wrapper if one is there."""
    cur = cls.__dict__.get(attr)
    inner = cur.__func__ if isinstance(cur, (classmethod, staticmethod)) else cur
    orig = getattr(inner, "__kvtrace_original__", None)
    return orig if orig is not None else cur


def _class_fields(cls: ast.ClassDef) -> list[str]:
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)]


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    have = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            have.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            have.add(node.target.id)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    have.add(t.id)
                    if t.id == "__slots__":
                        have |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    for node in ast.walk(cls):
        target = (node.target if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                  else node.targets if isinstance(node, ast.Assign) else None)
        for t in target if isinstance(target, list) else [target] if target is not None else []:
            for n in ast.walk(t):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    have.add(n.attr)
    return have


def _call_order(fn: ast.AST) -> list[str]:
    """Names of the attribute calls in a function, in source order (first occurrence each)."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    seen = []
    for c in calls:
        if c.func.attr not in seen:
            seen.append(c.func.attr)
    return seen
