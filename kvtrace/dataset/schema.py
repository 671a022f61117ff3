"""Schemas of the dataset's tables (documented in docs/schema.md). Bump SCHEMA_VERSION on
any incompatible change; the reader reads the versions in READABLE and refuses others with a
message naming them."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.hook.wire import CODEC

SCHEMA_VERSION = 2
# 1: no server kind in the run row; each kind's /metrics in a table of its own (V1_METRICS_TABLES).
# kvtrace.analysis.load reads such datasets as it reads version 2 (docs/schema.md, "Datasets of version 1").
READABLE = (1, 2)
META_KEY = b"kvtrace"

u32, u64, i32, i64, s = pa.uint32(), pa.uint64(), pa.int32(), pa.int64(), pa.string()
# Low-cardinality text (paths, syscalls, names) is dictionary-encoded: cheap to write and read.
d = pa.dictionary(pa.int32(), pa.string())
f64, b = pa.float64(), pa.bool_()

TABLES: dict[str, pa.Schema] = {
    "block_io": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("issue_ns", u64), ("pid", u32), ("tid", u32),
        ("comm", d), ("dev_major", u32), ("dev_minor", u32), ("disk", d), ("sector", u64),
        ("bytes", u64), ("op", d), ("rwbs", d), ("error", i32), ("queue_ns", i64),
        ("device_ns", i64), ("latency_ns", i64), ("weight", u32),
    ]),
    "file_io": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("syscall", d), ("fd", i32),
        ("path", d), ("offset", i64), ("requested", u64), ("iovcnt", u32), ("bytes", u64),
        ("ret", i64), ("latency_ns", i64), ("weight", u32),
    ]),
    "file_open": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("fd", i32), ("flags", u32),
        ("path", d), ("latency_ns", i64),
    ]),
    "io_uring": pa.schema([
        ("ts_ns", u64), ("submit_ns", u64), ("pid", u32), ("tid", u32), ("complete_tid", u32),
        ("opcode", u32), ("op", d), ("user_data", u64), ("res", i32), ("bytes", u64),
        ("latency_ns", i64), ("weight", u32),
    ]),
    # Exact in-kernel accounting of the three tables above (kvtrace.capture.agg), one row per
    # key that moved per flush: what changed in the interval ending at ts_ns.
    "block_agg": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("pid", u32), ("dev_major", u32), ("dev_minor", u32), ("disk", d),
        ("op", d), ("requests", u64), ("bytes", u64), ("errors", u64), ("latency_sum_ns", u64),
        ("queue_sum_ns", u64), ("device_sum_ns", u64),
    ]),
    "block_agg_hist": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("pid", u32), ("dev_major", u32), ("dev_minor", u32), ("disk", d),
        ("op", d), ("slot", u32), ("lo_ns", u64), ("hi_ns", u64), ("count", u64),
    ]),
    "file_agg": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("pid", u32), ("syscall", d), ("calls", u64), ("bytes", u64),
        ("errors", u64), ("requested", u64), ("latency_sum_ns", u64),
    ]),
    "file_agg_hist": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("pid", u32), ("syscall", d), ("slot", u32), ("lo_ns", u64),
        ("hi_ns", u64), ("count", u64),
    ]),
    "uring_agg": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("pid", u32), ("opcode", u32), ("op", d), ("completions", u64),
        ("bytes", u64), ("errors", u64), ("latency_sum_ns", u64),
    ]),
    "uring_agg_hist": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("pid", u32), ("opcode", u32), ("op", d), ("slot", u32),
        ("lo_ns", u64), ("hi_ns", u64), ("count", u64),
    ]),
    "processes": pa.schema([
        ("ts_ns", u64), ("pid", u32), ("tid", u32), ("event", d), ("child_pid", u32), ("comm", d),
    ]),
    # vLLM's KV-event stream (kvtrace.servers.kvevents): one row per block of each event.
    "kv_events": pa.schema([
        ("recv_ns", u64), ("seq", i64), ("batch_wall_ns", i64), ("dp_rank", i32), ("event_idx", u32),
        ("event", d), ("block_idx", u32), ("block_hash", u64), ("parent_hash", u64), ("token_count", u32),
        ("tokens_hash", u64), ("block_size", u32), ("medium", s), ("group_idx", i32), ("spec_kind", s),
        ("lora_id", i64), ("lora_name", s), ("session_id", s), ("replayed", b),
        # vLLM 0.2x-0.33's later fields, each by name; `reused`: a BlockStored of a block already
        # stored (kv_cache_report_mode "full" reports reused prefix blocks so): not a new store
        ("extra_keys", s), ("spec_window", i64), ("locality", s), ("ownership", s), ("lookahead_tokens", u32),
        ("reused", b),
        ("server", u32),   # the port of the server whose stream it is (0: an endpoint given without one)
    ]),
    # The traced server's Prometheus /metrics, its kind's samples per scrape (kvtrace.servers.metrics).
    "server_metrics": pa.schema([
        ("ts_ns", u64), ("kind", d), ("name", s), ("labels", s), ("value", f64), ("type", s),
        ("server", u32),   # the port of the server scraped (0: a --metrics-url without one)
    ]),
    # The servers a capture traces (one or several: a fleet's replicas on this host), one row per
    # process of each at the attach and after a restart: the join from any table's pid to its server.
    "servers": pa.schema([
        ("ts_ns", u64), ("server", u32), ("kind", d), ("version", s), ("pid", u32), ("role", d),
        ("api_pid", u32),
    ]),
    # The KV tier servers the traced engine's connectors reach (kvtrace.servers.tiers), found at
    # attach and traced with it: one row each (address: the host its connector is given; storage: its
    # lower tiers, "fs:<dir>", comma-separated).
    # A KV tier server's own metrics (kvtrace.attach.tiers), as server_metrics; kind: the tier's.
    "tier_metrics": pa.schema([
        ("ts_ns", u64), ("kind", d), ("name", s), ("labels", s), ("value", f64), ("type", s),
    ]),
    "tiers": pa.schema([
        ("ts_ns", u64), ("kind", d), ("pid", u32), ("address", s), ("port", u32), ("connector", s),
        ("version", s), ("storage", s), ("chunk_tokens", u32), ("same_netns", pa.bool_()), ("memory_bytes", u64),
    ]),
    # ---- NVMe(-oF), transport and NIC tables (probes nvme/tcp/rdma, kvtrace.fabric) ----
    # One row per NVMe command attempt (sampled under load: weight = commands it stands for).
    "nvme_cmd": pa.schema([
        ("ts_ns", u64), ("setup_ns", u64), ("latency_ns", i64), ("pid", u32), ("tid", u32), ("comm", d),
        ("issuer", d), ("setup_tid", u32), ("ctrl_id", u32), ("ctrl", d), ("transport", d), ("traddr", d),
        ("qid", u32), ("cid", u32), ("disk", d), ("nsid", u32), ("opcode", u32), ("op", d), ("opclass", d),
        ("slba", u64), ("nlb", u32), ("bytes", u64), ("status", u32), ("status_text", d), ("retries", u32),
        ("flags", u32), ("sq_occupancy", i32), ("weight", u32),
    ]),
    "nvme_async": pa.schema([
        ("ts_ns", u64), ("ctrl_id", u32), ("ctrl", d), ("transport", d), ("traddr", d), ("result", u32),
        ("type", d), ("event", d),
    ]),
    # Exact per-queue accounting from the kernel's maps, one row per queue and op class per flush.
    "nvme_queue": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("ctrl_id", u32), ("ctrl", d), ("transport", d), ("traddr", d),
        ("qid", u32), ("opclass", d), ("setups", u64), ("completions", u64), ("bytes", u64), ("errors", u64),
        ("retried", u64), ("unmatched", u64), ("unseen", u64), ("latency_sum_ns", u64), ("latency_avg_ns", f64),
        ("sq_samples", u64), ("sq_occupancy_avg", f64), ("sq_occupancy_max", u32), ("cpus", d),
    ]),
    "nvme_queue_hist": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("ctrl_id", u32), ("ctrl", d), ("qid", u32), ("opclass", d),
        ("slot", u32), ("lo_ns", u64), ("hi_ns", u64), ("count", u64),
    ]),
    "nvme_ctrl": pa.schema([
        ("ts_ns", u64), ("event", d), ("ctrl", d), ("ctrl_id", u32), ("transport", d), ("target", d),
        ("traddr", d), ("trsvcid", d), ("host_traddr", d), ("src_addr", d), ("address", d), ("subsysnqn", d),
        ("subsystem", d), ("iopolicy", d), ("state", d), ("cntlid", i64), ("model", d), ("serial", d),
        ("firmware", d), ("queue_count", i64), ("sqsize", i64), ("numa_node", i64), ("hostnqn", d),
    ]),
    "nvme_ns": pa.schema([
        ("ts_ns", u64), ("event", d), ("ctrl", d), ("ctrl_id", u32), ("disk", d), ("head", d), ("transport", d),
        ("target", d), ("nsid", i64), ("multipath", b), ("ana_state", d), ("ana_grpid", i64), ("lba_bytes", u64),
        ("size_bytes", u64), ("head_major", i64), ("head_minor", i64), ("mounts", pa.list_(s)),
    ]),
    "nvme_hctx": pa.schema([
        ("ts_ns", u64), ("ctrl", d), ("ctrl_id", u32), ("disk", d), ("hctx", u32), ("qid", u32),
        ("cpus", pa.list_(u32)), ("nr_tags", i64),
    ]),
    "tcp_events": pa.schema([
        ("ts_ns", u64), ("event", d), ("conn", d), ("saddr", d), ("sport", u32), ("daddr", d), ("dport", u32),
        ("family", d), ("state", d), ("newstate", d), ("srtt_us", u32), ("snd_cwnd", u32), ("ssthresh", u32),
        ("snd_wnd", u32), ("rcv_wnd", u32), ("data_len", u32), ("probes", u32), ("err", i32), ("skaddr", u64),
        ("sock_cookie", u64), ("pid", u32), ("tid", u32),
    ]),
    "rdma_events": pa.schema([
        ("ts_ns", u64), ("event", d), ("id", u32), ("cm_event", d), ("status", i32), ("tos", u32), ("qp_num", u32),
        ("src", d), ("dst", d), ("nr_cqe", i64), ("comp_vector", i64), ("poll_ctx", d), ("send_wr", i64),
        ("recv_wr", i64), ("qp_type", d), ("pid", u32), ("tid", u32), ("comm", d),
    ]),
    "rdma_cq": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("cq_id", u32), ("polls", u64), ("completions", u64),
        ("full_polls", u64), ("wakeups", u64), ("wakeup_latency_sum_us", u64), ("wakeup_latency_max_us", u64),
        ("interrupts", u64), ("reschedules", u64),
    ]),
    # Polled NIC/RDMA counters (kvtrace.fabric.counters): rows for counters that moved or
    # changed status, and every counter on full snapshots.
    "nic_counters": pa.schema([
        ("ts_ns", u64), ("interval_ns", u64), ("source", d), ("device", d), ("port", u32), ("netdev", d),
        ("name", d), ("raw", u64), ("value", u64), ("delta", u64), ("unit", d), ("status", d), ("rate", f64),
        ("full", b),
    ]),
    # Calls into user-space KV transfer libraries (UCX, cuFile, NIXL) by uprobes (--uprobe LIB).
    "ulib_calls": pa.schema([
        ("ts_ns", u64), ("entry_ns", u64), ("latency_ns", i64), ("pid", u32), ("tid", u32), ("lib", d), ("func", d),
        ("bytes", u64), ("arg", u64), ("ret", i64),
    ]),
    # Page faults of the traced processes on mapped files (probe filemap): reads through mmap.
    "file_map": pa.schema([
        ("ts_ns", u64), ("pid", u32), ("tid", u32), ("op", d), ("dev_major", u32), ("dev_minor", u32), ("ino", u64),
        ("first_page", u64), ("pages", u64),
    ]),
    # Derived by the correlator (kvtrace.correlate; docs/correlate.md) at a clean stop or by
    # `kvtrace correlate DIR`: one row per request, prefill chunk, engine step, attributed event.
    "requests": pa.schema([
        ("engine_pid", u32), ("request", s), ("external_id", s), ("arrival_ns", u64), ("first_scheduled_ns", u64),
        ("prefill_end_ns", u64), ("finish_ns", u64), ("start_ns", u64), ("end_ns", u64), ("queue_ns", i64),
        ("prompt_len", u32), ("admissions", u32), ("preemptions", u32), ("chunks", u32), ("prefill_tokens", u64),
        ("cached_tokens", u32), ("cached_local", u32), ("cached_external", u32), ("hit_blocks", u32),
        ("readmit_cached_tokens", u32), ("evicted_blocks", u32), ("load_count", u32), ("load_bytes", u64),
        ("load_ns", i64), ("store_count", u32), ("store_bytes", u64), ("storage_wait_ns", i64), ("compute_ns", i64),
        ("finished", b), ("joined_trace", b), ("trace_id", s), ("span_id", s), ("parent_span_id", s),
        # the first admission's prompt tokens by miss cause (with cached_local and cached_external
        # they sum to prompt_len; kvtrace.correlate.causes), and after preemptions the tokens
        # found again and recomputed
        ("miss_cold", u32), ("miss_unseen", u32), ("miss_evicted", u32), ("miss_inflight", u32), ("miss_tail", u32),
        ("miss_other_key", u32), ("miss_not_looked_up", u32), ("miss_tier_partial", u32), ("miss_other_engine", u32),
        ("miss_group", u32), ("miss_match_unit", u32), ("miss_spec_dropped", u32),
        ("readmit_recomputed_tokens", u32),
        # its loads from a KV connector as the scheduler drove it (kv_alloc, kv_done): the connector,
        # tokens and bytes loaded, the wait for its async loads, its failed loads
        ("kv_connector", s), ("connector_load_tokens", u32), ("connector_load_bytes", u64),
        ("connector_load_wait_ns", i64), ("connector_load_failed", u32),
        # the longest prompt prefix another engine of the run held at its first admission
        # (tokens; 0 with one engine): what it would have hit had it been sent there
        ("cached_elsewhere", u32),
    ]),
    # Every admission's tokens in runs of one cause (kvtrace.correlate.causes): a hit or why it missed.
    "token_causes": pa.schema([
        ("engine_pid", u32), ("request", s), ("attempt", u32), ("step", u64), ("token_start", u32),
        ("token_end", u32), ("tokens", u32), ("cause", d), ("block_hash", u64), ("evict_ns", u64), ("evicted_by", s),
        ("distance_blocks", u32), ("distance_ns", i64), ("computing", s), ("other_engine", u32),
        ("group", u32),
        ("elsewhere", u32),   # the admission's longest cached prefix in another engine (tokens)
    ]),
    # A prefill/decode pair (kvtrace.correlate.pd), in the decode run's partition: both sides,
    # the KV handed over as each side counted it, and the request's times on one timeline (the
    # reference host's wall clock; clock_shift_ns taken off the decode host's, clock_error_ns its
    # bound, null when no pair bounds it) with TTFT split into its parts.
    "handovers": pa.schema([
        ("d_pid", u32), ("d_request", s), ("p_run", s), ("p_host", s), ("p_pid", u32), ("p_request", s),
        ("how", s), ("connector", s), ("p_blocks", u32), ("p_bytes", u64), ("d_blocks", u32), ("d_bytes", u64),
        ("d_transport_calls", u32), ("d_transport_bytes", u64), ("clock_shift_ns", i64), ("clock_error_ns", i64),
        ("p_arrival_ns", i64), ("p_first_scheduled_ns", i64), ("p_prefill_end_ns", i64), ("d_arrival_ns", i64),
        ("d_loaded_ns", i64), ("d_first_token_ns", i64), ("queue_ns", i64), ("prefill_ns", i64),
        ("handoff_ns", i64), ("pull_ns", i64), ("first_decode_ns", i64), ("ttft_ns", i64),
    ]),
    "chunks": pa.schema([
        ("engine_pid", u32), ("step", u64), ("request", s), ("attempt", u32), ("chunk_index", i32),
        ("token_start", u32), ("token_end", u32), ("tokens", u32), ("prompt_len", u32), ("prefill_len", u32),
        ("last", b), ("resumed", b), ("cached_tokens", u32), ("cached_local", u32), ("cached_external", u32),
        ("hit_blocks", u32), ("evicted_blocks", u32), ("preempted_others", u32), ("load_count", u32),
        ("load_blocks", u32), ("load_bytes", u64), ("load_ns", i64), ("store_count", u32), ("store_bytes", u64),
        ("file_read_bytes", u64), ("block_read_bytes", u64), ("storage_wait_ns", i64), ("compute_ns", i64),
        ("sched_ns", i64), ("step_tokens", u32), ("shared_file_bytes", u64), ("shared_block_bytes", u64),
        ("nvme_commands", f64), ("nvme_bytes", f64), ("nvme_latency_avg_ns", f64), ("nvme_latency_max_ns", i64),
        ("t_start_ns", u64), ("t_end_ns", u64), ("bottleneck", d), ("trace_id", s), ("span_id", s),
        ("parent_span_id", s),
        # the tokens this chunk computed, by why they missed (kvtrace.correlate.causes)
        ("miss_cold", u32), ("miss_unseen", u32), ("miss_evicted", u32), ("miss_inflight", u32), ("miss_tail", u32),
        ("miss_other_key", u32), ("miss_not_looked_up", u32), ("miss_tier_partial", u32), ("miss_other_engine", u32),
        ("miss_group", u32), ("miss_match_unit", u32), ("miss_spec_dropped", u32),
    ]),
    "steps": pa.schema([
        ("engine_pid", u32), ("step", u64), ("t_start_ns", u64), ("t_sched_end_ns", u64), ("t_end_ns", u64),
        ("sched_ns", i64), ("exec_ns", i64), ("num_reqs", u32), ("total_tokens", u32), ("prefill_reqs", u32),
        ("prefill_tokens", u32), ("decode_reqs", u32), ("decode_tokens", u32), ("new_reqs", u32),
        ("resumed_reqs", u32), ("running", u32), ("waiting", u32), ("free_blocks", u32), ("chunks", u32),
        ("evicted_blocks", u32), ("preemptions", u32), ("load_count", u32), ("load_bytes", u64),
        ("store_count", u32), ("store_bytes", u64), ("storage_wait_ns", i64), ("compute_ns", i64),
        ("file_read_bytes", u64), ("file_write_bytes", u64), ("block_read_bytes", u64), ("block_write_bytes", u64),
        ("io_uring_bytes", u64), ("shared_file_bytes", u64), ("shared_block_bytes", u64),
        ("overlapping_steps", u32), ("nvme_commands", f64), ("nvme_bytes", f64), ("nic_deltas", s),
        ("bottleneck", d),
    ]),
    "attributions": pa.schema([
        ("source", d), ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("bytes", u64),
        ("engine_pid", u32), ("step", u64), ("request", d), ("attempt", u32), ("chunk_index", i32),
        ("transfer_start_ns", u64), ("how", d), ("candidates", u32), ("share", f64),
    ]),
}

RUNS = pa.schema([
    ("run", s), ("status", s), ("schema_version", i32), ("kvtrace_version", s), ("kernel", s),
    ("server_kind", s), ("server_version", s),
    ("start_ns", u64), ("stop_ns", u64), ("clock_offset_ns", i64), ("start_wall", s),
    ("pids", pa.list_(u32)), ("command", s), ("probes_attached", pa.list_(s)),
    ("probes_skipped", s), ("events", s), ("lost_events", s), ("dropped_events", u64),
    ("sidecars", s), ("sinks", s), ("sampling", s), ("kernel_skips", s),
])

# Tables of version 1 datasets that version 2 writes no more: each server kind's /metrics
# samples in a table of its own, in the columns of server_metrics but kind (which the table's
# name gives).  Table -> the kind (kvtrace.servers.registry) whose samples it holds.
V1_METRICS_TABLES = {"vllm_metrics": "vllm", "sglang_metrics": "sglang"}
V1_METRICS = pa.schema([("ts_ns", u64), ("name", s), ("labels", s), ("value", f64), ("type", s)])


# The hook's records (kvtrace.hook.wire) as the agent stores them (kvtrace.capture.usermark):
# each field with the Arrow type of its wire code, then the marker's mark_ns, pid and tid.
WIRE_TYPES = {"B": pa.uint8(), "H": pa.uint16(), "I": pa.uint32(), "Q": pa.uint64(), "b": pa.int8(),
              "h": pa.int16(), "i": pa.int32(), "q": pa.int64(), "d": pa.float64(), "s": pa.string(),
              "U": pa.list_(pa.uint64())}


def hook_schema(name: str) -> pa.Schema | None:
    """The schema of a hook table (None: no hook record of that name)."""
    spec = CODEC.by_name.get(name)
    if spec is None or any(code not in WIRE_TYPES for _, code in spec[1]):
        return None
    fields = [(f, WIRE_TYPES[code]) for f, code in spec[1]]
    return pa.schema(fields + [("mark_ns", u64), ("pid", u32), ("tid", u32)])


def conform(table: pa.Table, want: pa.Schema) -> pa.Table:
    """``table`` in the schema ``want``: a column it lacks (one a later version added) is null."""
    have = set(table.column_names)
    for f in want:
        if f.name not in have:
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    return table.select(want.names).cast(want)


def with_run(table: pa.Table, run: str) -> pa.Table:
    """The table with a leading ``run`` column (dictionary-encoded: cheap per row)."""
    col = pa.DictionaryArray.from_arrays(pa.array(np.zeros(table.num_rows, np.int32)), pa.array([run]))
    return table.add_column(0, pa.field("run", d), col)
