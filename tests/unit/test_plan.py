"""The hook's checks (kvtrace.hook.plan) on small source trees written here: each kind of
target passes on the form it needs and names what differs otherwise; classes are found
through re-exports and their bases; the same verdict for the same files, and a stale one
when a file changes.  (Against real vLLM releases: tests/vllm/test_plan.py.)"""
from __future__ import annotations

import os
import textwrap

import pytest

from kvtrace.hook import plan, support
from kvtrace.hook.source import SourceTree
from kvtrace.hook.vllm import releases
from kvtrace.hook.vllm import support as vllm_support

FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.1.0'\n",
    "vllm/core/__init__.py": "from vllm.core.impl import Sched as Sched\n",
    "vllm/core/base.py": """
        class Base:
            def base_method(self):
                self.from_base = 1
            @property
            def prop(self):
                return 1
    """,
    "vllm/core/impl.py": """
        from typing import TYPE_CHECKING, Generic
        from .base import Base
        if TYPE_CHECKING:
            from vllm.core.other import Ghost
        from dataclasses import dataclass

        class Sched(Base, Generic[int]):
            __slots__ = ("slotted",)
            level = 3
            def __init__(self):
                self.count: int = 0
                self.items = []
            def step(self, request, budget=4):
                self.driver.bind(request)
                self.driver.load()
                self.driver.save()
            def kw(self, request, *, budget):
                pass
            def var(self, request, *args):
                pass
            @classmethod
            def make(cls, config, role):
                pass

        @dataclass
        class Out:
            ids: list
            n: int = 0
    """,
}


@pytest.fixture
def tree(tmp_path):
    for rel, text in FILES.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def check(target, tree):
    return target.check(SourceTree(str(tree)))


def test_methods(tree):
    M = plan.Method
    assert check(M("vllm.core", "Sched", "step", ("self", "request")), tree) is None
    assert check(M("vllm.core", "Sched", "step", ("self", "req")), tree) == "parameter 'req' missing (takes self, request, budget)"
    assert check(M("vllm.core", "Sched", "step", ("self", "budget")), tree) == "takes (self, request, budget), expected (self, budget, ...)"
    assert check(M("vllm.core", "Sched", "step", ("self",), reads=("limit",)), tree) == "parameter 'limit' missing (takes self, request, budget)"
    assert check(M("vllm.core", "Sched", "kw", ("self", "request")), tree) == "has a keyword-only parameter 'budget'"
    assert check(M("vllm.core", "Sched", "kw", ("self", "request"), plain=False), tree) is None
    assert check(M("vllm.core", "Sched", "var", ("self", "request")), tree) == "has a variadic parameter 'args'"
    assert check(M("vllm.core", "Sched", "make", ("cls", "config", "role"), kind="classmethod"), tree) is None
    assert check(M("vllm.core", "Sched", "step", ("self",), kind="classmethod"), tree) == "is not a classmethod"
    assert check(M("vllm.core", "Sched", "make", ("cls",)), tree) == "is a classmethod"
    assert check(M("vllm.core", "Sched", "gone", ("self",)), tree) == "missing"
    # defined on a base: missing on the class itself (a wrapper goes on the class that owns it)
    assert check(M("vllm.core", "Sched", "base_method", ("self",)), tree) == "missing"
    assert check(M("vllm.core", "Sched", "base_method", ("self",), own=False), tree) is None
    assert check(M("vllm.core", "Nope", "step", ("self",)), tree) == "class missing"
    assert check(M("vllm.nowhere", "Sched", "step", ("self",)), tree) == "module missing"


def test_fields_attrs_globals(tree):
    assert check(plan.Fields("vllm.core.impl", "Out", ("ids", "n")), tree) is None
    assert check(plan.Fields("vllm.core.impl", "Out", ("ids", "m")), tree) == "field 'm' missing"
    ok = ("count", "items", "level", "slotted", "step", "from_base", "prop")
    assert check(plan.Attrs("vllm.core", "Sched", ok), tree) is None
    # a name imported only for type checking is not a runtime name
    assert check(plan.Attrs("vllm.core", "Sched", ("driver",)), tree) == "attribute 'driver' missing"
    assert check(plan.Globals("vllm.core.impl", ("Sched", "Base", "dataclass")), tree) is None
    assert check(plan.Globals("vllm.core.impl", ("Ghost",)), tree) == "'Ghost' missing"


def test_calls_and_strings(tree):
    C = plan.Calls
    assert check(C("vllm.core.impl", "Sched.step", ("bind", "load", "save")), tree) is None
    assert check(C("vllm.core.impl", "Sched.step", ("bind", "save", "load")), tree) == "calls load() before save()"
    assert check(C("vllm.core.impl", "Sched.step", ("bind", "flush")), tree) == "no longer calls flush()"
    assert check(C("vllm.core.impl", "Sched", ("save", "bind")), tree) is None   # a class: any order
    assert check(C("vllm.core.impl", "Sched.absent", ("bind",)), tree) == "missing"
    assert check(C("vllm.core.impl", "Sched.absent", ("bind",), optional=True), tree) is None
    assert check(plan.Strings("vllm.core.impl", ("bind",)), tree) == "no longer names 'bind'"
    assert check(plan.Strings("vllm.core.impl", ("slotted",)), tree) is None


def test_first_difference_and_verdict_files(tree):
    targets = [plan.Fields("vllm.core.impl", "Out", ("ids",)), plan.Attrs("vllm.core", "Sched", ("x", "y")),
               plan.Fields("vllm.core.impl", "Out", ("z",))]
    src = SourceTree(str(tree))
    t, why = plan.first_difference(targets, src)
    assert (t, why) == (targets[1], "attribute 'x' missing")
    assert plan.differences(targets, src) == ["Sched: attribute 'x' missing", "Out: field 'z' missing"]
    assert support.first(plan.differences(targets, src)) == "Sched: attribute 'x' missing (and 1 more)"
    assert src.version() == "9.1.0"
    assert set(src.files) == {"vllm/core/impl.py", "vllm/core/__init__.py", "vllm/core/base.py", "vllm/_version.py"}
    assert SourceTree(str(tree)).unchanged(src.files)
    p = tree / "vllm/core/base.py"
    p.write_text(p.read_text() + "\n")
    assert not SourceTree(str(tree)).unchanged(src.files)


def test_a_tree_without_vllm_is_refused_by_name(tmp_path):
    v = vllm_support.check(str(tmp_path))
    assert not v["supported"] and v["version"] is None and v["kind"] == "vllm"
    assert support.reason(v) == "vllm: no vLLM package here"


def test_release_rows_name_both_forms_when_neither_is_there(tree):
    have, bad = releases.forms(SourceTree(str(tree)), ("tensor_layers",))
    assert have == {"tensor_layers": False}
    assert bad == ["KVCacheTensor: module missing (and KVCacheTensor: module missing)"]
    assert {r.name for r in releases.ROWS} >= set(releases.CONNECTOR_ROWS)
    assert len(releases.ROWS) == len(releases.__doc__.split("\n| ")) - 2, "a row without its line in the table"
    for r in releases.ROWS:
        assert f"| {r.name} |" in releases.__doc__ and f"| {r.since} |" in releases.__doc__


def test_docs_list_every_release_row():
    """docs/hook.md's table of differences between releases is releases.ROWS, row for row."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "hook.md").read_text()
    rows = [line.strip().strip("|").split("|") for line in text.splitlines()
            if line.strip().startswith("| ") and line.count("|") == 5 and "newer form" not in line]
    got = [(c[0].strip(), c[2].strip(), c[3].strip()) for c in rows if c[0].strip() in {r.name for r in releases.ROWS}]
    assert got == [(r.name, r.since, r.without) for r in releases.ROWS]
