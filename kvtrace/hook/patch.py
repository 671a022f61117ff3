"""Patching the server's classes (vLLM's, SGLang's): the signature check, and wrapping one class attribute in a
module-global registry, so that install() is idempotent, uninstall() restores every original,
and a wrapper left by another copy of the hook (imported under another name) is replaced
instead of stacked on.  Standard library only.
"""
from __future__ import annotations

import inspect

from . import state
from .state import _MARK

_REGISTRY, _STATUS = state._REGISTRY, state._STATUS   # (bound by assignment: see kvtrace.hook.state)


def _signature_differs(func, want: list[str], strict: bool = True) -> str | None:
    """None when the leading parameter names are ``want`` (strict: and no other required one)."""
    if func is None:
        return "is missing"
    try:
        params = list(inspect.signature(inspect.unwrap(func)).parameters.values())
    except (TypeError, ValueError) as e:
        return f"has no readable signature ({e})"
    names = [p.name for p in params]
    if names[:len(want)] != want:
        return f"takes ({', '.join(names)}), expected ({', '.join(want)}, ...)"
    if strict:
        for p in params[len(want):]:
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                return f"has an extra required parameter {p.name!r}"
    return None


def _patch(cls: type, attr: str, wrap) -> None:
    """Wrap cls.attr once; a wrapper left by another copy of this module is replaced."""
    key = (cls, attr)
    if key in _REGISTRY:
        return
    current = cls.__dict__.get(attr)
    had_own = attr in cls.__dict__
    if current is not None and hasattr(_unbox(current), _MARK):  # wrapped by another module copy
        original = getattr(_unbox(current), _MARK)
        had_own = getattr(_unbox(current), "__kvtrace_had_own__", True)
    else:
        original = current if had_own else None
    base = original if original is not None else getattr(cls, attr)
    if isinstance(base, classmethod):
        wrapper = classmethod(wrap(base.__func__))
        inner = wrapper.__func__
    else:
        wrapper = inner = wrap(base)
    setattr(inner, _MARK, original if had_own else base)
    inner.__kvtrace_had_own__ = had_own
    inner.__name__ = attr
    inner.__qualname__ = f"{cls.__name__}.{attr}"
    inner.__wrapped__ = base.__func__ if isinstance(base, classmethod) else base
    setattr(cls, attr, wrapper)
    _REGISTRY[key] = (had_own, original, wrapper)
    _STATUS["patched"].append(f"{cls.__module__}.{cls.__qualname__}.{attr}")


def _original(cls, attr):
    """What the class's attribute wraps (the server's own method), or the attribute itself."""
    cur = _unbox(cls.__dict__.get(attr))
    return getattr(cur, _MARK, None) or cur


def _unbox(obj):
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def _unpatch_all() -> None:
    """Put back every attribute _patch wrapped (where it still holds our wrapper)."""
    for (cls, attr), (had_own, original, wrapper) in list(_REGISTRY.items()):
        try:
            if cls.__dict__.get(attr) is wrapper:
                if had_own:
                    setattr(cls, attr, original)
                else:
                    delattr(cls, attr)
        except Exception as e:
            state.T.error(e)
    _REGISTRY.clear()
