"""Wrappers with the exact parameters of the method they wrap (standard library only).

A wrapper written ``def f(self, *args, **kwargs): ... orig(self, *args, **kwargs)`` calls the
method through CPython's slow path for a call with unpacked arguments.  Measured in
bench/hookstep.py's real vLLM Scheduler, the hook's five engine wrappers done that way cost
3.1 µs an engine step doing nothing else, and 1.0 µs when each is a function with the method's
own parameters that calls it with them spelled out.  ``allocate_slots`` alone runs once per
running request and step.

``exact(orig, pre, post, abort, names, name)`` generates::

    def name(<orig's parameters, with orig's own default objects>):
        t = pre(self, <the parameters in names>)     # None: nothing to do after the call
        if t is None:
            return orig(<every parameter, in order>)
        try:
            r = orig(<every parameter, in order>)
        except BaseException:
            abort(self, t)
            raise
        post(self, t, r)
        return r

``pre``, ``post`` and ``abort`` must not raise (the hook's own catch and count errors).
``inline(orig, body, env, names, name)`` generates the same kind of function with any body,
``{call}`` standing for the call of ``orig``: for the hook's hottest methods, its work written
into the wrapper instead of a pre and a post call.
Only plain parameters can be spelled out: ``why_not(orig)`` names a positional-only,
keyword-only or variadic one, and the hook then leaves the server untouched.
"""
from __future__ import annotations

import inspect


def _params(func) -> list[inspect.Parameter]:
    return list(inspect.signature(func, follow_wrapped=False).parameters.values())


def why_not(func, names=()) -> str | None:
    """None when ``exact`` can wrap func and hand ``names`` to its ``pre``; else what stops it."""
    try:
        params = _params(func)
    except (TypeError, ValueError) as e:
        return f"has no readable signature ({e})"
    for p in params:
        if p.kind is not p.POSITIONAL_OR_KEYWORD:
            return f"has a {p.kind.description} parameter {p.name!r}"
        if p.name.startswith("_kv"):
            return f"has a parameter named {p.name!r}"
    missing = [n for n in ("self", *names) if n not in {p.name for p in params}]
    if missing:
        return f"has no parameter {missing[0]!r}"
    return None


EXACT_BODY = """\
_kv_t = _kv_pre({pre_args})
if _kv_t is None:
    return {call}
try:
    _kv_r = {call}
except BaseException:
    _kv_abort(self, _kv_t)
    raise
_kv_post(self, _kv_t, _kv_r)
return _kv_r
"""


def exact(orig, pre, post, abort, names, name: str, params_of=None):
    """The function above, for orig (TypeError when why_not says it cannot be made)."""
    return inline(orig, EXACT_BODY.replace("{pre_args}", ", ".join(("self", *names))),
                  {"_kv_pre": pre, "_kv_post": post, "_kv_abort": abort}, names, name, params_of)


def inline(orig, body: str, env: dict, names, name: str, params_of=None):
    """A function with orig's own parameters (and default objects) whose body is ``body``:
    Python source in which ``{call}`` stands for orig called with every parameter, the
    parameters in ``names`` (checked present) may be read, and the globals are ``env`` (names
    starting ``_kv``, as must the body's own locals: they cannot clash with a parameter).  For
    a hot method, the hook's work written into the body saves the calls of a pre and a post.
    ``params_of``: the function whose parameters to spell out, when orig is a decorator's
    ``*args, **kwargs`` wrapper of it (SGLang's stage-metric methods): orig is called with them."""
    why = why_not(params_of or orig, names)
    if why:
        raise TypeError(f"{name} {why}")
    params = _params(params_of or orig)
    ns = {"_kv_orig": orig, **env}
    spelled = []
    for i, p in enumerate(params):
        if p.default is p.empty:
            spelled.append(p.name)
        else:
            ns[f"_kv_default{i}"] = p.default     # the very object orig would use
            spelled.append(f"{p.name}=_kv_default{i}")
    call = f"_kv_orig({', '.join(p.name for p in params)})"
    lines = body.replace("{call}", call).splitlines()
    src = f"def {name}({', '.join(spelled)}):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(src, f"<kvtrace hook: {name}>", "exec"), ns)
    return ns[name]


def wrapper(orig, pre, post, abort, name: str):
    """exact(orig, pre, post, abort, (), name) where orig's parameters are all plain; otherwise
    the same steps through ``*args, **kwargs`` (pre then takes self alone either way)."""
    if why_not(orig) is None:
        return exact(orig, pre, post, abort, (), name)

    def generic(self, *args, **kwargs):
        t = pre(self)
        if t is None:
            return orig(self, *args, **kwargs)
        try:
            r = orig(self, *args, **kwargs)
        except BaseException:
            abort(self, t)
            raise
        post(self, t, r)
        return r

    generic.__name__ = name
    return generic
