"""The replay's cache models, keyed by ServerKind.cache_model (kvtrace.servers): a kind's model is
``model_for(kind name)``; an unknown kind is an error (registry.UnknownServerKind, exit 6)."""
from __future__ import annotations

from kvtrace.analysis.whatif.blockpool import BlockPool
from kvtrace.analysis.whatif.cache import CacheModel
from kvtrace.analysis.whatif.hybridpool import HybridPool
from kvtrace.analysis.whatif.radix import RadixCache
from kvtrace.servers import registry

MODELS: dict[str, type[CacheModel]] = {m.name: m for m in (BlockPool, RadixCache)}


def model_for(kind: str, groups: dict | None = None) -> type[CacheModel]:
    """The cache model of the server kind named ``kind``; a block pool with several KV cache
    groups (``groups``: the dataset's kv_group rows) is a hybrid one."""
    model = MODELS[registry.kind(kind).cache_model]
    if model is BlockPool and groups and len(groups) > 1:
        return HybridPool
    return model
