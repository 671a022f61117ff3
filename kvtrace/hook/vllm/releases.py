"""What differs between the vLLM releases the hook and the file connector support, in one
place: one row per difference, with the first release that has the newer form, how it is told
apart (a check of kvtrace.hook.plan on vLLM's source, never the version string), and what is
done without it.  The adapters below, and the choice of two engine wrappers in
kvtrace.hook.vllm.targets.engine_wrappers, are the only code that branches on a row.

| row | newer form | since | without it |
|---|---|---|---|
| step_counter | Scheduler.current_step | 0.23 | the hook numbers the scheduler's steps itself, on the scheduler, as later releases do |
| block_hash_sets | BlockPool.cached_block_hashes_by_block | 0.24 | a cached block holds one prefix hash: an eviction removes block_hash alone |
| connector_block_state | KVConnectorBlockState.get_block_ids | 0.30 | the file connector keeps each request's block ids from the scheduler output (0.29's block state is a snapshot of some requests only) |
| tensor_layers | KVCacheTensor.layers | 0.29 | the layers a tensor holds are KVCacheTensor.shared_by |
| cache_layout | KVCacheConfig.kv_cache_layout | 0.29 | the block files' layout.json records no layout name |
| hash_block_size | KVCacheConfig.hash_block_size | 0.32 | prefix hashes are taken per block (the hash block is the block) |
| cache_hit_source | vllm.v1.metrics.cache_hit_source | 0.32 | vLLM counts the connector's hits as external, without a source |
| pool_medium | BlockPool.medium | 0.30 | evictions are recorded with no medium (vLLM's KV events say GPU) |
| value_head_size | AttentionSpec.head_size_v | 0.28 | values have the keys' head size (the block files' layout.json says so) |
| unpadded_page | AttentionSpec.unpadded_page_size_bytes | 0.26 | a layer's block is AttentionSpec.real_page_size_bytes |

Where neither form of a row is there, the release is refused with that row's newer form named.
Standard library only (vLLM's source is read, not imported, by the checks).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import plan
from ..source import SourceTree
from .needs import IFACE, OUTPUT, POOL, SCHED


@dataclass(frozen=True)
class Row:
    name: str
    newer: object          # a target of kvtrace.hook.plan: the newer form
    since: str             # the first release with it
    older: object | None   # the form before it, or None when nothing is needed without it
    without: str           # what is done without the newer form


ROWS = (
    Row("step_counter", plan.Attrs(SCHED, "Scheduler", ("current_step",)), "0.23", None,
        "the hook numbers the scheduler's steps itself, on the scheduler, as later releases do"),
    Row("block_hash_sets", plan.Attrs(POOL, "BlockPool", ("cached_block_hashes_by_block",)), "0.24", None,
        "a cached block holds one prefix hash: an eviction removes block_hash alone"),
    Row("connector_block_state", plan.Attrs(OUTPUT, "KVConnectorBlockState", ("get_block_ids",)), "0.30",
        plan.Fields(OUTPUT, "CachedRequestData", ("new_block_ids", "resumed_req_ids")),
        "the file connector keeps each request's block ids from the scheduler output (0.29's block state is a "
        "snapshot of some requests only)"),
    Row("tensor_layers", plan.Fields(IFACE, "KVCacheTensor", ("layers",)), "0.29",
        plan.Fields(IFACE, "KVCacheTensor", ("shared_by",)), "the layers a tensor holds are KVCacheTensor.shared_by"),
    Row("cache_layout", plan.Fields(IFACE, "KVCacheConfig", ("kv_cache_layout",)), "0.29", None,
        "the block files' layout.json records no layout name"),
    Row("hash_block_size", plan.Fields(IFACE, "KVCacheConfig", ("hash_block_size",)), "0.32", None,
        "prefix hashes are taken per block (the hash block is the block)"),
    Row("cache_hit_source", plan.Globals("vllm.v1.metrics.cache_hit_source", ("CacheHitSource",)), "0.32", None,
        "vLLM counts the connector's hits as external, without a source"),
    Row("pool_medium", plan.Attrs(POOL, "BlockPool", ("medium",)), "0.30", None,
        "evictions are recorded with no medium (vLLM's KV events say GPU)"),
    Row("value_head_size", plan.Attrs(IFACE, "AttentionSpec", ("head_size_v",)), "0.28", None,
        "values have the keys' head size (the block files' layout.json says so)"),
    Row("unpadded_page", plan.Attrs(IFACE, "AttentionSpec", ("unpadded_page_size_bytes",)), "0.26",
        plan.Attrs(IFACE, "AttentionSpec", ("real_page_size_bytes",)), "a layer's block is AttentionSpec.real_page_size_bytes"),
)
# The rows the file connector depends on (the hook reads pool_medium with a default).
CONNECTOR_ROWS = ("connector_block_state", "tensor_layers", "cache_layout", "hash_block_size", "cache_hit_source",
                  "value_head_size", "unpadded_page")


def forms(src: SourceTree, names=None) -> tuple[dict[str, bool], list[str]]:
    """({row: newer form present}, rows where neither form is: "target: what differs")."""
    have, bad = {}, []
    for row in ROWS:
        if names is not None and row.name not in names:
            continue
        why = row.newer.check(src)
        have[row.name] = why is None
        if why is not None and row.older is not None:
            old = row.older.check(src)
            if old is not None:
                bad.append(f"{row.newer.label}: {why} (and {row.older.label}: {old})")
    return have, bad


_HAVE: dict[str, bool] = {}


def has(name: str) -> bool:
    """Whether this interpreter's vLLM has the newer form of a row (checked once per process,
    or told by the agent's verdict on the same files: know())."""
    if not _HAVE:
        _HAVE.update(forms(SourceTree.of_imported_vllm())[0])
    return _HAVE[name]


def know(have: dict[str, bool]) -> None:
    """The rows' forms as the agent found them in this vLLM's files (kvtrace.hook.vllm.install)."""
    if set(have) == {r.name for r in ROWS}:
        _HAVE.update(have)


def version() -> str:
    """The version of the vLLM this interpreter imports, as its records name it ("?" unknown)."""
    try:
        import vllm

        return str(getattr(vllm, "__version__", "?"))
    except Exception:
        return "?"


# ---------------------------------------------------------------------------------------------
# Adapters: the file connector's reads of what differs


def layer_names(tensor) -> list[str]:
    """The layers one KVCacheTensor holds."""
    return list(tensor.layers if has("tensor_layers") else tensor.shared_by)


def layout_name(kv_cache_config) -> str | None:
    layout = kv_cache_config.kv_cache_layout if has("cache_layout") else None
    return None if layout is None else str(layout)


def value_head_size(spec) -> int:
    return spec.head_size_v if has("value_head_size") else spec.head_size


def page_bytes(spec) -> int:
    """Bytes of one block of one layer, without the padding vLLM may add to a page."""
    return spec.unpadded_page_size_bytes if has("unpadded_page") else spec.real_page_size_bytes


def hash_block_size(kv_cache_config) -> int | None:
    return kv_cache_config.hash_block_size if has("hash_block_size") else None


def cache_hit_source(name: str):
    """vLLM's CacheHitSource member ``name`` (e.g. "DISK"), or None where /metrics has no source."""
    if not has("cache_hit_source"):
        return None
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return getattr(CacheHitSource, name)


class TrackedBlockIds:
    """Each request's block ids (first KV cache group), kept from the scheduler output, for a
    vLLM whose scheduler output carries no block state for connectors (row
    connector_block_state): new requests bring their block ids, running ones the ids added
    this step, resumed ones their whole list again."""

    def __init__(self):
        self.ids: dict[str, list[int]] = {}

    def update(self, so) -> None:
        for r in so.scheduled_new_reqs:
            self.ids[r.req_id] = list(r.block_ids[0])
        cached = so.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            if new is None:
                continue
            if rid in cached.resumed_req_ids:
                self.ids[rid] = list(new[0])
            else:
                self.ids.setdefault(rid, []).extend(new[0])

    def get(self, req_id: str) -> tuple[list[int], ...] | None:
        ids = self.ids.get(req_id)
        return None if ids is None else (ids,)

    def drop(self, req_id: str) -> None:
        self.ids.pop(req_id, None)


def block_ids_source():
    """None where vLLM hands connectors each request's block ids (the scheduler output's block
    state, else the KV cache manager bound to the connector); else a TrackedBlockIds."""
    return None if has("connector_block_state") else TrackedBlockIds()
