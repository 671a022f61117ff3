"""kvtrace.hook.exact: wrappers with the wrapped method's own parameters."""
import inspect

import pytest

from kvtrace.hook.exact import exact, why_not

SENTINEL = object()


class Pool:
    def allocate(self, request, n, computed=0, blocks=None, flag=SENTINEL):
        if n < 0:
            raise ValueError("negative")
        return (request, n, computed, blocks, flag is SENTINEL)


def make(calls, skip=False):
    def pre(self, request, blocks):
        calls.append(("pre", request, blocks))
        return None if skip else ("token", request)

    def post(self, t, r):
        calls.append(("post", t, r))

    def abort(self, t):
        calls.append(("abort", t))

    return exact(Pool.allocate, pre, post, abort, ("request", "blocks"), "allocate")


def test_calls_pass_through_unchanged_with_the_same_defaults():
    calls = []
    w = make(calls)
    p = Pool()
    assert inspect.signature(w) == inspect.signature(Pool.allocate).replace(
        parameters=[q.replace(annotation=q.empty) for q in inspect.signature(Pool.allocate).parameters.values()])
    for args, kwargs in [((1, 2), {}), ((1, 2, 3), {"flag": 9}), ((), {"request": 1, "n": 2, "blocks": "b"}),
                         ((1,), {"n": 5, "computed": 4})]:
        calls.clear()
        assert w(p, *args, **kwargs) == Pool.allocate(p, *args, **kwargs)
        r = Pool.allocate(p, *args, **kwargs)
        assert calls == [("pre", r[0], r[3]), ("post", ("token", r[0]), r)]
    assert w(p, 1, 2)[4] is True   # the default object itself reached the method


def test_pre_returning_none_skips_post():
    calls = []
    assert make(calls, skip=True)(Pool(), "r", 1) == ("r", 1, 0, None, True)
    assert calls == [("pre", "r", None)]


def test_an_exception_of_the_method_runs_abort_and_propagates():
    calls = []
    with pytest.raises(ValueError, match="negative"):
        make(calls)(Pool(), "r", -1)
    assert calls == [("pre", "r", None), ("abort", ("token", "r"))]


def test_wrong_arguments_fail_as_they_would_without_the_wrapper():
    w = make([])
    for bad in [lambda: w(Pool()), lambda: w(Pool(), 1, 2, nope=3), lambda: w(Pool(), 1, 2, 3, 4, 5, 6)]:
        with pytest.raises(TypeError):
            bad()


def test_why_not_names_what_cannot_be_spelled_out():
    def variadic(self, a, *rest): ...
    def keywords(self, a, **kw): ...
    def kwonly(self, a, *, b=1): ...
    def posonly(self, a, /, b): ...
    def clash(self, _kv_t): ...

    assert why_not(Pool.allocate, ("request", "blocks")) is None
    assert why_not(variadic) == "has a variadic positional parameter 'rest'"
    assert why_not(keywords) == "has a variadic keyword parameter 'kw'"
    assert why_not(kwonly) == "has a keyword-only parameter 'b'"
    assert why_not(posonly) == "has a positional-only parameter 'self'"
    assert why_not(clash) == "has a parameter named '_kv_t'"
    assert why_not(Pool.allocate, ("request", "missing")) == "has no parameter 'missing'"
    with pytest.raises(TypeError, match="allocate has a variadic"):
        exact(variadic, None, None, None, (), "allocate")


def test_wrapper_falls_back_to_args_and_kwargs_where_parameters_are_not_plain():
    from kvtrace.hook.exact import wrapper

    class Conn:
        def start(self, ctx, **kwargs):
            return (ctx, kwargs)

        def wait(self, layer):
            if layer == "bad":
                raise KeyError(layer)
            return layer

    calls = []
    pre = lambda self: calls.append(("pre", type(self).__name__)) or 7   # noqa: E731
    post = lambda self, t, r: calls.append(("post", t, r))               # noqa: E731
    abort = lambda self, t: calls.append(("abort", t))                    # noqa: E731
    start = wrapper(Conn.start, pre, post, abort, "start")
    wait = wrapper(Conn.wait, pre, post, abort, "wait")
    assert start.__code__.co_filename.endswith("exact.py")              # the generic one
    assert wait.__code__.co_filename == "<kvtrace hook: wait>"          # spelled out
    c = Conn()
    assert start(c, 1, x=2) == (1, {"x": 2})
    assert wait(c, layer="l0") == "l0"
    with pytest.raises(KeyError):
        wait(c, "bad")
    assert calls == [("pre", "Conn"), ("post", 7, (1, {"x": 2})), ("pre", "Conn"), ("post", 7, "l0"),
                     ("pre", "Conn"), ("abort", 7)]


def test_inline_writes_a_body_around_the_call_with_the_parameters_checked():
    from kvtrace.hook.exact import inline

    seen = []
    body = "_kv_seen.append((request, blocks))\ntry:\n    return {call}\nfinally:\n    _kv_seen.append('after')\n"
    w = inline(Pool.allocate, body, {"_kv_seen": seen}, ("request", "blocks"), "allocate")
    p = Pool()
    assert w(p, "r", 2, blocks="b") == Pool.allocate(p, "r", 2, blocks="b")
    assert w(p, "r", 2)[4] is True                     # orig's own default object
    with pytest.raises(ValueError, match="negative"):
        w(p, "x", -1)
    assert seen == [("r", "b"), "after", ("r", None), "after", ("x", None), "after"]
    with pytest.raises(TypeError, match="allocate has no parameter 'missing'"):
        inline(Pool.allocate, body, {}, ("missing",), "allocate")


def _inlined_hook(monkeypatch):
    """The hook's inlined wrappers on stand-ins of vLLM's classes, with records on."""
    from kvtrace.hook.vllm import targets as hook

    monkeypatch.setattr(hook.S, "rec", True)
    monkeypatch.setattr(hook.S, "cur_req", "outer")
    # everything the wrappers write is put back after the test (the module's state is shared)
    for obj, attrs in ((hook.S, ("last_alloc", "alloc_failures")),
                       (hook.W, ("active", "depth", "waits", "wait_ns", "last_wait_end")),
                       (hook.T, ("errors", "last_error"))):
        for attr in attrs:
            monkeypatch.setattr(obj, attr, getattr(obj, attr))
    errors = hook.T.errors
    return hook, errors


def test_the_inlined_allocate_restores_the_allocating_request_and_counts_its_own_errors(monkeypatch):
    hook, errors = _inlined_hook(monkeypatch)

    class Manager:
        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                           num_external_computed_tokens=0, delay_cache_blocks=False):
            if num_new_tokens < 0:
                raise RuntimeError("vLLM's own error")
            return None if num_new_tokens > 100 else (hook.S.cur_req, num_new_tokens)

    class Req:
        request_id = "r1"

    alloc = hook._inlined(hook.ALLOCATE_BODY, hook.ALLOC_PARAMS)(Manager.allocate_slots)
    failures = hook.S.alloc_failures
    m = Manager()
    assert alloc(m, Req(), 4) == ("r1", 4) and hook.S.cur_req == "outer" and hook.S.last_alloc == "r1"
    assert alloc(m, Req(), 101) is None and hook.S.alloc_failures == failures + 1
    with pytest.raises(RuntimeError, match="vLLM's own error"):
        alloc(m, Req(), -1)
    assert hook.S.cur_req == "outer"
    assert alloc(m, object(), 4) == ("outer", 4)       # no request_id: counted, vLLM's call still made
    assert hook.T.errors == errors + 1


def test_the_inlined_layer_wait_times_only_the_outermost_call_and_survives_the_connectors_error(monkeypatch):
    hook, _ = _inlined_hook(monkeypatch)

    class Conn:
        def wait_for_layer_load(self, layer_name):
            if layer_name == "bad":
                raise KeyError(layer_name)
            if layer_name == "nested":
                return wait(self, "inner")
            return layer_name

    wait = hook._any_params(hook._timed_pre, hook._layer_done, hook._layer_done, hook.LAYER_BODY)(Conn.wait_for_layer_load)
    assert wait.__code__.co_filename == "<kvtrace hook: wait_for_layer_load>"
    hook.W.active, hook.W.waits, hook.W.wait_ns = True, 0, 0
    c = Conn()
    assert wait(c, "l0") == "l0" and wait(c, layer_name="nested") == "inner"
    with pytest.raises(KeyError):
        wait(c, "bad")
    assert hook.W.waits == 3 and hook.W.depth == 0 and hook.W.wait_ns > 0
    hook.W.active = False                              # not in a recorded Worker step: not timed
    assert wait(c, "l1") == "l1" and hook.W.waits == 3
