-- Prefill chunks, slowest first, with the storage I/O placed on them and on their step.
--
-- Time per chunk as `kvtrace analyze` splits it (docs/analysis.md, "Time per chunk"):
--   queue    waiting for the step (since the request's arrival, since its preemption for a
--            re-admission, or since the end of its previous chunk's step) + the step's schedule()
--   storage  KV-load wait inside the step's execute window (every chunk of the step waits)
--   compute  the rest of the execute window
-- I/O (docs/correlate.md): the connector loads naming the request in this step; the kernel reads
-- on a load's thread while it ran (thread_time: file_read_bytes, block_read_bytes; kernel_ios
-- counts those requests, writes included); the chunk's share of the step's I/O that names no
-- request (shared_bytes); the step's NVMe commands and all its storage reads.
-- Reads the derived tables: run `kvtrace correlate DIR` once if the capture did not stop cleanly.
-- Run from the dataset directory (examples/README.md); add LIMIT 10 for the top 10.
WITH c AS (
  SELECT *, LAG(t_end_ns) OVER (PARTITION BY run, engine_pid, request, attempt ORDER BY step) AS prev_end
  FROM read_parquet('chunks/*/*/*.parquet', hive_partitioning = true)
),
att AS (SELECT * FROM read_parquet('attributions/*/*/*.parquet', hive_partitioning = true)),
preempted AS (  -- re-admission k follows the request's k-th preemption
  SELECT run, engine_pid, request, ts_ns,
         ROW_NUMBER() OVER (PARTITION BY run, engine_pid, request ORDER BY ts_ns) AS attempt
  FROM att WHERE source = 'preempt'
),
kernel_io AS (
  SELECT run, engine_pid, step, request, attempt, chunk_index, COUNT(*) AS ios
  FROM att WHERE source IN ('block_io', 'file_io', 'io_uring') AND request <> '' GROUP BY ALL
),
t AS (
  SELECT c.*, s.file_read_bytes + s.block_read_bytes + s.io_uring_bytes AS step_read_bytes,
         GREATEST(CAST(c.t_start_ns AS BIGINT) - CAST(COALESCE(c.prev_end,
                  CASE WHEN c.attempt = 0 THEN NULLIF(r.arrival_ns, 0) ELSE p.ts_ns END, c.t_start_ns) AS BIGINT), 0)
           + c.sched_ns AS queue_ns,
         COALESCE(k.ios, 0) AS kernel_ios
  FROM c
  JOIN read_parquet('steps/*/*/*.parquet', hive_partitioning = true) s USING (run, engine_pid, step)
  LEFT JOIN read_parquet('requests/*/*/*.parquet', hive_partitioning = true) r USING (run, engine_pid, request)
  LEFT JOIN preempted p USING (run, engine_pid, request, attempt)
  LEFT JOIN kernel_io k USING (run, engine_pid, step, request, attempt, chunk_index)
)
SELECT run, request, attempt, chunk_index, step, tokens,
       (queue_ns + storage_wait_ns + compute_ns) / 1e6 AS total_ms,
       queue_ns / 1e6 AS queue_ms, storage_wait_ns / 1e6 AS storage_ms, compute_ns / 1e6 AS compute_ms,
       CASE WHEN storage_wait_ns > compute_ns AND storage_wait_ns >= queue_ns THEN 'storage'
            WHEN queue_ns > compute_ns AND queue_ns > storage_wait_ns THEN 'queueing'
            WHEN attempt > 0 THEN 'recompute' ELSE 'compute' END AS verdict,
       load_count AS kv_loads, load_bytes AS kv_load_bytes, load_ns / 1e6 AS kv_load_ms,
       kernel_ios, file_read_bytes, block_read_bytes, shared_file_bytes + shared_block_bytes AS shared_bytes,
       step_read_bytes, nvme_commands, nvme_latency_avg_ns / 1e3 AS nvme_latency_avg_us
FROM t
ORDER BY total_ms DESC, run, step, request, attempt;
