"""What the hook needs of LMCache's multiprocess server, target by target (the kinds of
kvtrace.hook.plan; what each gives: kvtrace.hook.lmcache.tier).  Checked on LMCache's source
before patching; verified on lmcache 0.5.6 (live in tests/lmcache).  All are looked up on each
call, so patching them after the server started takes effect (its RPC handlers, bound at start,
are not patched).  Standard library only."""
from __future__ import annotations

from ..plan import Attrs, Fields, Method

SM = "lmcache.v1.distributed.storage_manager"
API = "lmcache.v1.distributed.api"
PREFETCH = "lmcache.v1.distributed.storage_controllers.prefetch_controller"
EVICTION = "lmcache.v1.distributed.storage_controllers.eviction_controller"
FS = "lmcache.v1.distributed.l2_adapters.fs_l2_adapter"
TRANSFER = "lmcache.v1.multiprocess.modules.server_transfer"
TYPES = "lmcache.v1.multiprocess.custom_types"

# The methods wrapped; two of StorageManager's carry a tracing decorator (functools.wraps): their
# parameters are read from the function it wraps.  FSL2Adapter's two are coroutines.
METHODS = (
    Method(SM, "StorageManager", "submit_prefetch_task", ("self", "spec", "external_request_id")),
    Method(SM, "StorageManager", "query_prefetch_status", ("self", "handle")),
    Method(PREFETCH, "PrefetchController", "_submit_load_tasks", ("self", "request", "reserved_objs")),
    Method(FS, "FSL2Adapter", "_execute_load", ("self", "keys", "objects", "task_id")),
    Method(FS, "FSL2Adapter", "_execute_store", ("self", "keys", "objects", "task_id")),
    Method(TRANSFER, "PickleTransferStrategy", "prepare_retrieve", ("self", "key", "instance_id")),
    Method(TRANSFER, "PickleTransferStrategy", "commit_store", ("self", "key", "instance_id", "cpu_data")),
    Method(EVICTION, "L1EvictionController", "execute_eviction_action", ("self", "action")),
)

READS = (
    Fields(API, "PrefetchHandle", ("prefetch_request_id", "external_request_id", "total_requested_keys")),
    Fields(API, "PrefetchResult", ("l1_hit_cells", "l2_hit_cells")),
    Attrs(API, "PrefetchResult", ("l1_hit_count", "l2_hit_count")),
    Fields(API, "PrefetchTaskSpec", ("key_groups",)),
    Attrs(PREFETCH, "InFlightPrefetchRequest", ("request_id", "inflight_load_tasks")),
    Attrs(PREFETCH, "PrefetchController", ("_l2_adapters",)),
    Attrs(FS, "FSL2Adapter", ("_completed_load_tasks",)),
    Fields(TYPES, "IPCCacheServerKey", ("start", "end", "request_id")),
    Fields(TYPES, "PrepareRetrieveResponse", ("success", "data")),
)
