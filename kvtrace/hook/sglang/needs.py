"""What the hook needs of SGLang, target by target (the kinds of kvtrace.hook.plan; how SGLang's
names map to the records: kvtrace.hook.sglang.engine).  Checked on SGLang's source before
patching, and by the agent before injecting; verified on sglang 0.5.23 (CPU engine, live in
tests/sglang).  Standard library only."""
from __future__ import annotations

from ..plan import Attrs, Fields, Method, Strings

SCHED = "sglang.srt.managers.scheduler"
BATCH = "sglang.srt.managers.schedule_batch"
RADIX = "sglang.srt.mem_cache.unified_radix_cache"

# The methods wrapped.  Two carry SGLang's stage-metric decorator (a *args/**kwargs wrapper):
# their parameters are read from the function it wraps (kvtrace.hook.sglang.hook).
METHODS = (
    Method(SCHED, "Scheduler", "get_next_batch_to_run", ("self", "running_batch", "last_batch")),
    Method(SCHED, "Scheduler", "process_batch_result", ("self", "batch")),
    Method(SCHED, "Scheduler", "update_running_batch", ("self", "batch")),
    Method(SCHED, "Scheduler", "_add_request_to_queue", ("self", "req", "is_retracted")),
    Method(BATCH, "ScheduleBatch", "prepare_for_extend", ("self",)),
    Method(BATCH, "ScheduleBatch", "retract_decode", ("self",)),
    Method(RADIX, "UnifiedRadixCache", "_evict_device_leaf", ("self", "node_id")),
)

READS = (
    Attrs(SCHED, "Scheduler", ("forward_ct", "running_batch", "waiting_queue", "token_to_kv_pool_allocator",
                               "tree_cache")),
    Fields(BATCH, "NextBatchPlan", ("batch_to_run",)),
    Fields(BATCH, "ScheduleBatch", ("reqs", "prefix_lens", "extend_lens", "forward_mode", "chunked_req",
                                    "token_to_kv_pool_allocator")),
    Attrs(BATCH, "Req", ("rid", "origin_input_ids", "output_ids", "full_untruncated_fill_ids", "retraction_count", "extend_len",
                         "finished", "sampling_params", "cache_salt", "lora_id")),
    Attrs(RADIX, "UnifiedRadixCache", ("tree_core", "metrics_collector")),
    Attrs("sglang.srt.observability.metrics_collector", "RadixCacheMetricsCollector", ("eviction_num_tokens", "labels")),
    Attrs("sglang.srt.mem_cache.rust_tree_core.adapter", "RustUnifiedTreeCore", ("get_hash_values",)),
    # the scheduler's process title, by which the agent finds it
    Strings(SCHED, ("sglang::scheduler",)),
)
