"""The hook's Worker wrappers: the KV connector API, timed on the class of each connector vLLM
creates, as one kv_step record per Worker step on the shared queue (kvtrace.hook.state), and the
Worker's state (W).

  bind_connector_metadata / start_load_kv / wait_for_layer_load / save_kv_layer / wait_for_save
                                                                   kv_load, kv_store (kv_step2)

What is patched with what is in kvtrace.hook.vllm.targets; this module holds the wrappers' work.
Every name a wrapper reads is a global of this module (imported from kvtrace.hook.state once).
"""
from __future__ import annotations

import os
import threading
import time

from .. import state
from ..state import (FLUSH_EVERY_NS, _enqueue, _flush, _hook_start, _leave_if_owner_gone, _monotonic_ns, _new_agent,
                     _refresh)
from . import releases

# The shared state's objects are bound here by assignment (see kvtrace.hook.vllm.engine).
T, _Q, _LOCK, _last = state.T, state._Q, state._LOCK, state._last


class _Worker:
    """Worker state: the connector step being timed; reset when the agent goes away."""

    __slots__ = ("active", "on", "seen_check", "agents", "seq", "depth", "source", "t_bind", "load_t0",
                 "load_t1", "waits", "wait_ns", "last_wait_end", "saves", "save_ns", "save_first")

    def __init__(self):
        self.active = False
        self.on = False
        self.seen_check = 0
        self.agents: frozenset = frozenset()
        self.seq = 0
        self.depth = 0
        self.source = ""
        self.begin(0)

    def begin(self, now):
        self.t_bind = now
        self.load_t0 = self.load_t1 = 0
        self.waits = self.wait_ns = self.last_wait_end = 0
        self.saves = self.save_ns = self.save_first = 0


W = _Worker()


def _bind_pre(self):
    """bind_connector_metadata (a Worker step starts): never anything to do after the call."""
    try:
        if _refresh():
            now = _monotonic_ns()
            if _new_agent(W) or not W.on:
                W.on = True
                _hook_start("worker", "vllm", releases.version())
            W.active = True
            W.seq += 1
            W.source = "connector:" + type(self).__name__
            W.begin(now)
        else:
            if W.on:
                W.on = False
                with _LOCK:
                    _Q.clear()
                _leave_if_owner_gone()
            W.active = False
    except Exception as e:
        T.error(e)
    return None


def _timed_pre(self):
    """start_load_kv, wait_for_layer_load, wait_for_save: their start, in a recorded Worker step
    and not inside another of them (a connector calling its own API)."""
    if not W.active or W.depth:
        return None
    W.depth += 1
    return _monotonic_ns()


def _load_done(self, t0, out=None) -> None:
    W.depth -= 1
    if not W.load_t0:
        W.load_t0 = t0
    W.load_t1 = _monotonic_ns()


def _layer_done(self, t0, out=None) -> None:
    W.depth -= 1
    t1 = _monotonic_ns()
    W.waits += 1
    W.wait_ns += t1 - t0
    W.last_wait_end = t1


def _save_layer_done(self, t0, out=None) -> None:
    W.depth -= 1
    t1 = _monotonic_ns()
    if not W.saves:
        W.save_first = t0
    W.saves += 1
    W.save_ns += t1 - t0


def _save_done(self, t0, out=None) -> None:
    W.depth -= 1
    _save_end(t0)


def _save_end(t0: int) -> None:
    try:
        _worker_step_end(t0, _monotonic_ns())
    except Exception as e:
        T.error(e)


# The same three, written into wrappers with the connector's own parameters (kvtrace.hook.exact
# inline): wait_for_layer_load runs once per layer and step, and a pre and a post function per
# call would cost more than the timing.  Only attribute writes on W happen after the call.
_TIMED_HEAD = """\
_kv_w = _kv_W
if not _kv_w.active or _kv_w.depth:
    return {call}
_kv_w.depth = 1
_kv_t0 = _kv_mono()
try:
    return {call}
finally:
    _kv_w.depth = 0
"""
LOAD_BODY = _TIMED_HEAD + """\
    if not _kv_w.load_t0:
        _kv_w.load_t0 = _kv_t0
    _kv_w.load_t1 = _kv_mono()
"""
LAYER_BODY = _TIMED_HEAD + """\
    _kv_t1 = _kv_mono()
    _kv_w.waits += 1
    _kv_w.wait_ns += _kv_t1 - _kv_t0
    _kv_w.last_wait_end = _kv_t1
"""
SAVE_LAYER_BODY = _TIMED_HEAD + """\
    _kv_t1 = _kv_mono()
    if not _kv_w.saves:
        _kv_w.save_first = _kv_t0
    _kv_w.saves += 1
    _kv_w.save_ns += _kv_t1 - _kv_t0
"""
SAVE_BODY = _TIMED_HEAD + """\
    _kv_save_end(_kv_t0)
"""


def _worker_step_end(t_save0: int, t_save1: int) -> None:
    W.active = False
    # one record for the step's kv_load and kv_store rows (the agent splits it: wire.kv_step_rows)
    if W.load_t0:
        _enqueue(("kv_step2", W.load_t0, max(W.load_t1, W.last_wait_end), W.load_t1, W.seq, W.waits, W.wait_ns,
                  t_save0, t_save1, 1, W.source, W.saves, W.save_ns, W.save_first))
    else:   # no start_load_kv: the load, if a layer waited, spans bind to the last wait
        _enqueue(("kv_step2", W.t_bind, W.last_wait_end, W.t_bind, W.seq, W.waits, W.wait_ns,
                  t_save0, t_save1, 1 if W.waits else 0, W.source, W.saves, W.save_ns, W.save_first))
    if t_save1 - _last["flush"] >= FLUSH_EVERY_NS:
        _flush(t_save1)
    else:
        _LATER.arm()


class _Later:
    """Sends the Worker's records FLUSH_EVERY_NS after they were queued, from a daemon thread
    that sleeps otherwise: a Worker cannot tell whether another step will come to send them.
    Its frames name the Worker's thread, whose id joins a kv_load or kv_store to that thread's
    file I/O.  Arming costs an Event.set() once per interval and no system call: the thread
    starts on first use in each process (threads do not survive a fork, which resets this),
    and the calling thread's native id is asked of the kernel once per thread."""

    def __init__(self):
        self.started = False
        self.tid = 0
        self.ev = threading.Event()
        self.local = threading.local()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.forked)

    def forked(self) -> None:
        self.started = False
        self.ev = threading.Event()
        self.local = threading.local()   # the forking thread's id is not the child's

    def arm(self) -> None:
        tid = getattr(self.local, "tid", 0)
        if not tid:
            tid = self.local.tid = threading.get_native_id()
        self.tid = tid
        if not self.started:
            self.started = True
            threading.Thread(target=self._run, args=(self.ev,), name="kvtrace-hook-send", daemon=True).start()
        if not self.ev.is_set():
            self.ev.set()

    def _run(self, ev: threading.Event) -> None:
        while True:
            ev.wait()
            time.sleep(FLUSH_EVERY_NS / 1e9)
            ev.clear()
            try:
                _flush(time.monotonic_ns(), self.tid)
            except Exception as e:  # never into vLLM, never out of the loop
                T.error(e)


_LATER = _Later()
