-- Requests with their prefix-cache hit ratio and time to first token.
--
-- hit_ratio = cached / prompt tokens of the first admission (local prefix cache + KV connector),
-- what vLLM returns as usage.prompt_tokens_details.cached_tokens / prompt_tokens.
-- TTFT = end of the step of the request's first final prefill chunk - its arrival (its first
-- step's start when the hook saw no arrival), as `kvtrace analyze` reports it.
-- Reads the derived tables; run from the dataset directory.
SELECT r.run, r.request, r.prompt_len, r.cached_local, r.cached_external,
       r.cached_tokens / r.prompt_len AS hit_ratio,
       (MIN(c.t_end_ns) - ANY_VALUE(IF(r.arrival_ns > 0, r.arrival_ns, r.first_scheduled_ns))) / 1e6 AS ttft_ms,
       r.queue_ns / 1e6 AS queue_ms, r.chunks, r.preemptions, r.evicted_blocks, r.load_bytes
FROM read_parquet('requests/*/*/*.parquet', hive_partitioning = true) r
JOIN read_parquet('chunks/*/*/*.parquet', hive_partitioning = true) c USING (run, engine_pid, request)
WHERE c.last
GROUP BY ALL
ORDER BY r.run, ANY_VALUE(r.start_ns), r.request;
