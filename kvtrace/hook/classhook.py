"""What the hooks that wrap a server's classes by name share (SGLang's scheduler, LMCache's
server): the wrapper factory that sees through a decorator, the check of each method on the
imported class, and the plan of what to patch.  Standard library only."""
from __future__ import annotations

import importlib
import inspect

from . import plan, state
from .exact import exact, why_not
from .patch import _patch, _unpatch_all
from .support import first


def _nothing(self, t) -> None:
    """abort: nothing to undo when the method raised."""


def decorated(pre, post, abort=None, names=()):
    """The wrapper factory of one method: pre, the method, post, with the method's own
    parameters (those of the function a decorator wraps, where one does)."""
    def wrap(orig):
        inner = inspect.unwrap(orig)
        return exact(orig, pre, post, abort or _nothing, names, orig.__name__,
                     params_of=inner if inner is not orig else None)

    return wrap


def live_differs(cls, m) -> str | None:
    """The method ``m`` (a plan.Method) on the imported class, through a decorator's wrapper to
    the function it wraps: None when its wrapper can be made.  A coroutine function is wrapped by
    a coroutine with its leading parameters, which must be m's."""
    raw = plan._original(cls, m.name)
    if raw is None:
        return "missing"
    inner = inspect.unwrap(raw)
    if inspect.iscoroutinefunction(inner):
        have = list(inspect.signature(inner).parameters)[:len(m.params)]
        return None if have == list(m.params) else f"takes {', '.join(have)}"
    return why_not(inner, tuple(p for p in m.params if p != "self"))


def items(methods, bad: list[str], wrappers: dict) -> list[tuple]:
    """(class, method name, wrapper factory) of each method not already named in ``bad`` (the
    source check's differences), each also checked on its imported class (what differs there
    is added to ``bad``)."""
    out = []
    for m in methods:
        if any(b.startswith(m.label + ":") for b in bad):
            continue
        cls = getattr(importlib.import_module(m.module), m.cls)
        why = live_differs(cls, m)
        if why:
            bad.append(f"{m.label}: {why}")
        out.append((cls, m.name, wrappers[m.label]))
    return out


def unpatch() -> None:
    """Restore every wrapped attribute, then send what is queued (never raises)."""
    _unpatch_all()
    try:
        state._flush(state._monotonic_ns())
    except Exception:
        pass
    state._STATUS.update(installed=False, roles=[], patched=[], reason="uninstalled")


def status(kind: str) -> dict:
    """The hook's status and its transport's counts, for the agent's injection report."""
    t = state.T
    return {**state._STATUS, "patched": list(state._STATUS["patched"]), "emitted": t.emitted, "dropped": t.dropped,
            "errors": t.errors, "last_error": t.last_error, "kind": kind}


def apply(items: list, bad: list[str], *, kind: str, title: str, version: str, role: str, log, left) -> bool:
    """Patch ``items`` when nothing differs (``bad`` empty), register ``left`` for when the agent
    that injected the hook is gone; else patch nothing and say the first difference once."""
    if bad:
        return inert(f"{title} {version} differs: {first(bad)}", log, differences=bad)
    for cls, attr, wrap in items:
        _patch(cls, attr, wrap)
    state.on_leave(left)
    state._STATUS.update(installed=True, roles=[role], reason="", differences=[], kind=kind)
    return True


def inert(reason: str, log, **more) -> bool:
    """Nothing patched, and why (one warning in the server's log)."""
    state._STATUS.update(installed=False, reason=reason, **more)
    log.warning("kvtrace hook inactive (nothing patched): %s", reason)
    return False
