-- Time to first token by prefix-cache hit ratio, in 10% buckets.
--
-- Requests bucketed by cached / prompt tokens of their first admission (a full hit counts in
-- 90-100%); hit ratio and TTFT as in requests.sql.  Run from the dataset directory.
WITH r AS (
  SELECT r.run, r.request, r.prompt_len, r.cached_tokens,
         LEAST(CAST(FLOOR(10 * r.cached_tokens / r.prompt_len) AS INTEGER), 9) AS decile,
         (MIN(c.t_end_ns) - ANY_VALUE(IF(r.arrival_ns > 0, r.arrival_ns, r.first_scheduled_ns))) / 1e6 AS ttft_ms
  FROM read_parquet('requests/*/*/*.parquet', hive_partitioning = true) r
  JOIN read_parquet('chunks/*/*/*.parquet', hive_partitioning = true) c USING (run, engine_pid, request)
  WHERE c.last
  GROUP BY ALL
)
SELECT printf('%d-%d%%', 10 * decile, 10 * decile + 10) AS hit_ratio, COUNT(*) AS requests,
       CAST(SUM(prompt_len) AS BIGINT) AS prompt_tokens, CAST(SUM(cached_tokens) AS BIGINT) AS cached_tokens,
       AVG(ttft_ms) AS ttft_avg_ms, quantile_disc(ttft_ms, 0.5) AS ttft_p50_ms,
       quantile_disc(ttft_ms, 0.9) AS ttft_p90_ms, MAX(ttft_ms) AS ttft_max_ms
FROM r
GROUP BY decile
ORDER BY decile;
