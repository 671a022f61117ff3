"""A vLLM engine's KV cache groups, sent once per agent (wire record ``kv_group``), and, where
there are several, each group's share of the cache snapshot (``cached_in``).

A hybrid model (full attention beside sliding-window, chunked-local or Mamba layers) has one
KV cache group per layer kind, all drawing blocks from one pool.  Each group caches a block
under (hash, group) and evicts it on its own: a sliding-window group frees its blocks below the
window while the request still runs, so they go first.  The miss-cause replay
(kvtrace.correlate.causes) keeps each group's cache and applies vLLM's hybrid hit rule with
these rows; nothing here runs per step.
"""
from __future__ import annotations

import re

from .. import state
from ..state import _enqueue
from ..wire import PROMPT_PIECE

T = state.T


def send(sched, now: int) -> int:
    """One kv_group record per group of the scheduler's KV cache config; the number of groups."""
    try:
        groups = list(sched.kv_cache_config.kv_cache_groups)
    except Exception as e:
        T.error(e)
        return 0
    kvm = getattr(sched, "kv_cache_manager", None)
    coord = getattr(kvm, "coordinator", None)
    managers = list(getattr(coord, "single_type_managers", ()) or ())
    base = int(getattr(sched, "block_size", 0) or 0)
    hash_block = int(getattr(coord, "hash_block_size", 0) or base)
    align = int(_align(coord) or hash_block)
    try:
        num_blocks = int(sched.kv_cache_config.num_blocks)
    except Exception:
        num_blocks = 0
    retention = getattr(coord, "retention_interval", -1)   # releases before sparse retention: every block
    retention = -1 if retention is None else int(retention)
    for gid, g in enumerate(groups):
        try:
            spec = g.kv_cache_spec
            m = managers[gid] if gid < len(managers) else None
            bs = int(getattr(m, "block_size", 0) or getattr(spec, "block_size", 0) or base)
            window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None) or 0
            layers = len(getattr(g, "layer_names", ()) or ())
            page = int(getattr(spec, "page_size_bytes", 0) or 0) * layers
            eagle = bool(getattr(m, "use_eagle", False) or getattr(kvm, "use_eagle", False))
            _enqueue(("kv_group", now, gid, kind(spec), bs, int(window), layers, page, hash_block, align, num_blocks,
                      retention, eagle))
        except Exception as e:
            T.error(e)
    return len(groups)


def _align(coord) -> int:
    """Tokens a hit must be a multiple of: the hybrid coordinator's alignment, else its
    scheduler block size (releases that have one), else 0 (the block)."""
    for attr in ("_cache_hit_alignment_tokens", "scheduler_block_size"):
        try:
            v = getattr(coord, attr, None)
        except Exception:
            v = None
        if v:
            return int(v)
    return 0


def kind(spec) -> str:
    """FullAttentionSpec -> "full_attention", SlidingWindowSpec -> "sliding_window", ..."""
    name = type(spec).__name__
    name = name[:-4] if name.endswith("Spec") else name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()[:48]


def snapshot(keys: list, hashes: list[int], now: int) -> None:
    """The `cached` snapshot's keys (BlockHashWithGroupId: the last four bytes are the group) and
    their KV-event hashes, split by group as cached_in records."""
    by_group: dict[int, list[int]] = {}
    for k, h in zip(keys, hashes):
        by_group.setdefault(int.from_bytes(k[-4:], "big"), []).append(h)
    for g, hashes in sorted(by_group.items()):
        for i in range(0, len(hashes), PROMPT_PIECE):
            _enqueue(("cached_in", now, g, i, len(hashes), hashes[i:i + PROMPT_PIECE]))
