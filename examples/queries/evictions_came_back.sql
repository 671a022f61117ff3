-- Evicted KV blocks that a later request needed again, and whether it got them back.
--
-- Each eviction (the vLLM hook's `evict` record: block hash, the request whose allocation evicted
-- it) is paired with the next admission, in a later step, whose prompt holds that hash at an index
-- it could hit (< (prefill_len - 1) // block_size), as `kvtrace analyze` pairs them
-- ("Eviction -> re-reference", docs/analysis.md).  Outcome at that admission:
--   restored  a local prefix-cache hit (someone computed the block again in between)
--   reloaded  covered by the KV connector's hit (read back from storage)
--   lost      recomputed (thrash)
-- Evictions never needed again are left out.  Needs the hook's `evict` and `prompt_blocks` tables
-- and the derived `chunks` table.  Run from the dataset directory.
WITH evicted AS (
  SELECT run, pid AS engine_pid, step, t_ns, block_hash, request AS evicted_by,
         ROW_NUMBER() OVER (ORDER BY run, pid, step, t_ns, block_hash) AS eviction
  FROM read_parquet('evict/*/*/*.parquet', hive_partitioning = true)
),
prompt AS (  -- every request's prompt as its chain of block hashes, one row per block
  SELECT DISTINCT run, engine_pid, request, block_size, idx, hash FROM (
    SELECT run, pid AS engine_pid, request, block_size,
           first + generate_subscripts(hashes, 1) - 1 AS idx, unnest(hashes) AS hash
    FROM read_parquet('prompt_blocks/*/*/*.parquet', hive_partitioning = true))
),
admission AS (  -- the first chunk of each admission carries its hit
  SELECT run, engine_pid, request, attempt, step, t_start_ns, prefill_len, cached_local, cached_external
  FROM read_parquet('chunks/*/*/*.parquet', hive_partitioning = true) WHERE chunk_index = 0
),
needed AS (
  SELECT e.*, a.request, a.attempt, a.step AS needed_step, a.t_start_ns AS needed_ns, p.idx, p.block_size,
         a.cached_local, a.cached_external
  FROM evicted e
  JOIN prompt p ON p.run = e.run AND p.engine_pid = e.engine_pid AND p.hash = e.block_hash
  JOIN admission a ON a.run = p.run AND a.engine_pid = p.engine_pid AND a.request = p.request AND a.step > e.step
  WHERE p.idx < (a.prefill_len - 1) // NULLIF(p.block_size, 0)
  QUALIFY ROW_NUMBER() OVER (PARTITION BY e.eviction ORDER BY a.step, a.request, a.attempt) = 1
)
SELECT run, step AS evicted_step, evicted_by, block_hash, request AS needed_by, attempt, needed_step,
       idx AS block_index,
       CASE WHEN idx * block_size < cached_local THEN 'restored'
            WHEN idx * block_size < cached_local + cached_external THEN 'reloaded'
            ELSE 'lost' END AS outcome,
       needed_step - step AS steps_later, (needed_ns - t_ns) / 1e6 AS ms_later
FROM needed
ORDER BY run, evicted_step, t_ns, block_index;
