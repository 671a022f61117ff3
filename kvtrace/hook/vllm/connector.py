"""The hook's view of any KV connector from the scheduler that drives it (EngineCore), with no
help from the connector: what vLLM asked of it and what it answered, per request.

  KVCacheManager.allocate_slots (with external tokens)   kv_alloc: the external hit, the blocks
                                                          and bytes it loads into, sync or async
  Scheduler._update_from_kv_xfer_finished                 kv_done (async loads and stores that
                                                          finished, loads that failed), kv_invalid
  Scheduler._connector_finished                           kv_finish: the blocks handed to the
                                                          connector at a request's end

Bytes are blocks × the KV cache's bytes per block of their group (page size of the group's
spec × its layers) × the tensor-parallel ranks (the spec is one rank's share of the KV heads;
each rank moves its own), counted from the block ids vLLM hands the connector; block 0 of vLLM's
pool (its null block) holds nothing and is not counted.  kvtrace.hook.vllm.engine starts and stops
this module's state (C) with its own.
"""
from __future__ import annotations

from .. import state
from ..state import MAX_TRACKED, _enqueue, _monotonic_ns

T = state.T


class _Connector:
    """The scheduler's connector while recording: its name, each KV cache group's (tokens per
    block, bytes per block, null block id), and the block ids of each load not yet done."""

    __slots__ = ("on", "conn", "kvg", "loads")

    def __init__(self):
        self.reset()

    def reset(self):
        self.on = False
        self.conn = ""
        self.kvg: list[tuple[int, int, int]] = []
        self.loads: dict[str, frozenset] = {}


C = _Connector()


def start(sched) -> None:
    """At recording start (engine._engine_on), from the scheduler's connector and KV cache config."""
    C.reset()
    conn = getattr(sched, "connector", None)
    if conn is None:
        return
    C.conn = _name(conn)
    try:
        null = sched.kv_cache_manager.block_pool.null_block.block_id
    except Exception:
        null = 0
    try:
        tp = int(sched.vllm_config.parallel_config.tensor_parallel_size)
    except Exception:
        tp = 1
    for g in sched.kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        C.kvg.append((int(spec.block_size), int(spec.page_size_bytes) * len(g.layer_names) * max(tp, 1), null))
    C.on = True


def _name(conn) -> str:
    """The connector's class name; a MultiConnector's with those it stacks."""
    inner = getattr(conn, "_connectors", None)
    name = type(conn).__name__
    if inner:
        name += "(" + "+".join(type(c).__name__ for c in inner) + ")"
    return name[:120]


def _count(ids_by_group, first_tok: int, ntok: int) -> tuple[int, int, list[int]]:
    """(blocks, bytes, block ids) of tokens [first_tok, first_tok + ntok) in each group's ids."""
    blocks = nbytes = 0
    chosen: list[int] = []
    for g, ids in enumerate(ids_by_group):
        if g >= len(C.kvg):
            break
        bs, per_block, null = C.kvg[g]
        sel = [b for b in ids[first_tok // bs:-(-(first_tok + ntok) // bs)] if b != null]
        blocks += len(sel)
        nbytes += len(sel) * per_block
        chosen += sel
    return blocks, nbytes, chosen


def note_alloc(kvm, step: int, request, local: int, external: int, delay) -> None:
    """allocate_slots granted an admission with ``external`` tokens to load (called after it, in
    a recorded step): kv_alloc, and the load's block ids kept for a later invalid-block report."""
    if not C.on:
        return
    rid = request.request_id
    first = int(request.num_computed_tokens or 0) + int(local or 0)
    blocks, nbytes, ids = _count(kvm.get_block_ids(rid), first, int(external))
    if len(C.loads) >= MAX_TRACKED:
        C.loads.clear()
    C.loads[rid] = frozenset(ids)
    _enqueue(("kv_alloc", step, _monotonic_ns(), rid, first, int(external), blocks, nbytes, 1 if delay else 0,
              C.conn))


def xfer_pre(self, kv_connector_output):
    return kv_connector_output if C.on else None


def xfer_post(self, out, _r) -> None:
    """What the workers reported done this step: async loads (finished_recving) and stores or
    sends (finished_sending), failed loads (failed_recving), blocks that failed to load."""
    try:
        now, step, conn = _monotonic_ns(), self.current_step, C.conn
        bad = getattr(out, "invalid_block_ids", None)
        if bad:   # first: a load's failed blocks may come with its completion
            _invalid(step, now, set(bad), conn)
        failed = set(getattr(out, "failed_recving", None) or ())
        for rid in out.finished_recving or ():
            _enqueue(("kv_done", step, now, rid, "load", 0 if rid in failed else 1, conn))
            C.loads.pop(rid, None)
        for rid in failed - set(out.finished_recving or ()):
            _enqueue(("kv_done", step, now, rid, "load", 0, conn))
        for rid in out.finished_sending or ():
            _enqueue(("kv_done", step, now, rid, "store", 1, conn))
    except Exception as e:
        T.error(e)


def _invalid(step: int, now: int, bad: set, conn: str) -> None:
    """kv_invalid per request whose load holds any of the ``bad`` block ids (request "" for
    the ids no load the hook saw holds)."""
    left = set(bad)
    for rid, ids in list(C.loads.items()):
        hit = ids & bad
        if hit:
            _enqueue(("kv_invalid", step, now, rid, len(hit), conn))
            left -= hit
    if left:
        _enqueue(("kv_invalid", step, now, "", len(left), conn))


def finished_pre(self, request):
    if not C.on:
        return None
    return request


def finished_post(self, request, out) -> None:
    """_connector_finished returned (delay_free, params): kv_finish with the blocks of the
    request's computed tokens it handed the connector (as vLLM does, before freeing them)."""
    try:
        rid = request.request_id
        C.loads.pop(rid, None)
        kvm = self.kv_cache_manager
        try:
            ids = kvm.get_block_ids_for_computed_tokens(request_id=rid,
                                                        num_computed_tokens=request.num_computed_tokens)
        except Exception:
            ids = kvm.get_block_ids(rid)
        blocks, nbytes, _ = _count(ids, 0, int(request.num_computed_tokens))
        delay = out[0] if isinstance(out, tuple) and out else False
        _enqueue(("kv_finish", self.current_step, _monotonic_ns(), rid, blocks, nbytes, 1 if delay else 0, C.conn))
    except Exception as e:
        T.error(e)
