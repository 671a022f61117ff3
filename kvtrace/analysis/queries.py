"""The analysis as SQL that DuckDB and Spark SQL both run unchanged (docs/analysis.md defines
every figure).  VIEWS are created in order after the tables are registered (kvtrace.analysis.
engine); FIGURES are the queries whose rows make up the report.

Portability rules kept here: CAST for every division or floor, percentile_disc(p) WITHIN GROUP
(ORDER BY x) for percentiles (nearest rank: identical in both engines), ORDER BY on every
multi-row result, no engine-specific functions except regexp_extract (same in both).
"""
from __future__ import annotations

from kvtrace.analysis import connector, fleet, handover, tier

READS = "('read', 'pread64', 'readv', 'preadv', 'preadv2')"
STORAGE_PATH = ("path LIKE '/%' AND NOT (path LIKE '/proc/%' OR path LIKE '/sys/%' OR "
                "(path LIKE '/dev/%' AND NOT (path LIKE '/dev/nvme%' OR path LIKE '/dev/sd%' OR path LIKE '/dev/vd%' "
                "OR path LIKE '/dev/dm-%' OR path LIKE '/dev/md%' OR path LIKE '/dev/mapper/%')))")


CAUSES = ("hit_local", "hit_external", "miss_cold", "miss_unseen", "miss_evicted", "miss_inflight", "miss_tail",
          "miss_other_key", "miss_not_looked_up", "miss_tier_partial",
          "miss_other_engine", "miss_group", "miss_match_unit",
          "miss_spec_dropped")   # kvtrace.correlate.causes.CAUSES
CAUSE_COLUMNS = ", ".join(f"SUM(CASE WHEN cause = '{c}' THEN tokens ELSE 0 END) AS {c}" for c in CAUSES)


def pct(col: str, name: str, ps=(0.5, 0.95, 0.99)) -> str:
    return ", ".join(f"percentile_disc({p}) WITHIN GROUP (ORDER BY {col}) AS {name}_p{int(round(p * 100))}" for p in ps)


BUCKET_NS = 10_000_000_000
BUCKET = "CAST(FLOOR({x} / %d) AS BIGINT)" % BUCKET_NS


# Views left unmaterialized: as large as a kernel table, and each reader wants other columns of
# it, so reading the Parquet columns again costs less than storing every row once.
LAZY = {"fread"}


def views(default_block_size: int = 0) -> list[tuple[str, str]]:
    """(name, SELECT) in creation order."""
    return [*_record_views(), *_block_size_views(default_block_size), *_timing_views(), *_reuse_views(),
            *connector.VIEWS, *tier.VIEWS]


def _record_views() -> list[tuple[str, str]]:
    """The storage file reads, and each hook table's records once."""
    return [
        # file reads on storage, by directory (first: the figures of the kernel tables need
        # nothing else, so an engine with workers starts them while the rest is made)
        # (rows sampled 1 in N while the kernel was overloaded carry weight N: counts and bytes use it)
        ("fdir", f"""SELECT path, regexp_extract(path, '^(.*)/', 1) AS dir FROM (SELECT DISTINCT path FROM file_io) p
                     WHERE {STORAGE_PATH}"""),
        ("fread", f"""SELECT d.dir, f.bytes, f.start_ns, f.ts_ns, f.latency_ns, COALESCE(NULLIF(f.weight, 0), 1) AS w
                     FROM file_io f JOIN fdir d ON d.path = f.path
                     WHERE f.syscall IN {READS} AND f.ret >= 0"""),
        # admissions, chunks and steps once each (a record sent twice never counts twice)
        ("adm", """SELECT run, pid, step, request, attempt, prompt_len, prefill_len, cached_local, cached_external,
                   tok_start, hit_blocks, resumed FROM (SELECT a.*, ROW_NUMBER() OVER (
                   PARTITION BY run, pid, request, attempt ORDER BY step, tok_start) AS rn FROM admit a) t WHERE rn = 1"""),
        ("chk", """SELECT run, pid, step, request, attempt, chunk_index, tok_start, tok_len, prompt_len, prefill_len,
                   is_last, resumed FROM (SELECT c.*, ROW_NUMBER() OVER (
                   PARTITION BY run, pid, request, attempt, step ORDER BY tok_start) AS rn FROM chunk c) t WHERE rn = 1"""),
        ("stp", """SELECT run, pid, step, t_start_ns, t_sched_end_ns, t_end_ns, t_sched_end_ns - t_start_ns AS sched_ns,
                   t_end_ns - t_sched_end_ns AS exec_ns, total_tokens, prefill_tokens, decode_tokens, decode_reqs,
                   num_reqs, waiting, running, preempted, evicted, alloc_failures, free_blocks
                   FROM (SELECT s.*, ROW_NUMBER() OVER (PARTITION BY run, pid, step ORDER BY t_start_ns) AS rn
                   FROM step s) t WHERE rn = 1"""),
        ("arr", "SELECT run, pid, request, MIN(t_ns) AS t_ns FROM arrive WHERE t_ns > 0 GROUP BY run, pid, request"),
        ("pre", "SELECT run, pid, request, attempt, MIN(t_ns) AS t_ns FROM preempt GROUP BY run, pid, request, attempt"),
    ]


def _block_size_views(default_block_size: int) -> list[tuple[str, str]]:
    return [
        # tokens per block, per engine: from the prompt records, else hit tokens / hit blocks, else --block-size
        ("bsz", f"""SELECT s.run, s.pid, COALESCE(MAX(u.b), {int(default_block_size)}) AS bs
                   FROM (SELECT DISTINCT run, pid FROM stp) s LEFT JOIN (
                     SELECT run, pid, block_size AS b FROM prompt_blocks WHERE block_size > 0
                     UNION ALL SELECT run, pid, CAST(cached_local / hit_blocks AS BIGINT) AS b FROM adm WHERE hit_blocks > 0
                   ) u ON u.run = s.run AND u.pid = s.pid GROUP BY s.run, s.pid"""),
    ]


def _timing_views() -> list[tuple[str, str]]:
    """Storage wait per step and the time of each chunk."""
    return [
        # storage wait per step: the union of KV-load intervals inside the step's execute window
        # (steps and loads meet in 10 s time buckets: an equi-join instead of a range join; loads
        # longer than a bucket take the range join)
        ("swait", f"""WITH sb AS (SELECT run, pid, step, t_sched_end_ns, t_end_ns, {BUCKET.format(x='t_sched_end_ns')} AS bk FROM stp
                           UNION SELECT run, pid, step, t_sched_end_ns, t_end_ns, {BUCKET.format(x='t_end_ns')} AS bk FROM stp),
                     lb AS (SELECT run, t_start_ns, t_end_ns, {BUCKET.format(x='t_start_ns')} AS bk FROM kv_load
                            UNION SELECT run, t_start_ns, t_end_ns, {BUCKET.format(x='t_end_ns')} AS bk FROM kv_load),
                     pairs AS (
                       SELECT DISTINCT s.run, s.pid, s.step, s.t_sched_end_ns, s.t_end_ns, l.t_start_ns AS ls, l.t_end_ns AS le
                       FROM sb s JOIN lb l ON l.run = s.run AND l.bk = s.bk
                       WHERE l.t_start_ns < s.t_end_ns AND l.t_end_ns > s.t_sched_end_ns
                       UNION
                       SELECT s.run, s.pid, s.step, s.t_sched_end_ns, s.t_end_ns, l.t_start_ns AS ls, l.t_end_ns AS le
                       FROM stp s JOIN kv_load l ON l.run = s.run AND l.t_start_ns < s.t_end_ns AND l.t_end_ns > s.t_sched_end_ns
                       WHERE l.t_end_ns - l.t_start_ns >= {BUCKET_NS}),
                     ld AS (SELECT run, pid, step, GREATEST(ls, t_sched_end_ns) AS a, LEAST(le, t_end_ns) AS b FROM pairs),
                     o AS (SELECT run, pid, step, a, b, MAX(b) OVER (PARTITION BY run, pid, step ORDER BY a, b
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pe FROM ld)
                     SELECT run, pid, step, SUM(GREATEST(b - GREATEST(a, COALESCE(pe, a)), 0)) AS wait_ns
                     FROM o GROUP BY run, pid, step"""),
        ("span", """SELECT run, pid, request, MIN(step) AS first_step, MAX(step) AS last_step FROM chk
                    WHERE attempt = 0 GROUP BY run, pid, request"""),
        # one row per chunk: queueing (since arrival, preemption or the previous chunk), schedule(),
        # storage wait and compute of its step, and the verdict
        ("ctime", """WITH c AS (SELECT c.*, LAG(step) OVER (PARTITION BY run, pid, request, attempt ORDER BY step) AS prev_step
                               FROM chk c),
                     t AS (
                       SELECT c.run, c.pid, c.request, c.attempt, c.chunk_index, c.step, c.tok_start, c.tok_len,
                         c.is_last, c.prompt_len, c.prefill_len, s.t_start_ns, s.t_end_ns, s.sched_ns, s.exec_ns,
                         s.total_tokens AS step_tokens, COALESCE(w.wait_ns, 0) AS storage_ns,
                         s.exec_ns - COALESCE(w.wait_ns, 0) AS compute_ns,
                         GREATEST(CASE WHEN c.prev_step IS NOT NULL THEN s.t_start_ns - ps.t_end_ns
                                       WHEN c.attempt = 0 AND ar.t_ns IS NOT NULL THEN s.t_start_ns - ar.t_ns
                                       WHEN c.attempt > 0 AND pr.t_ns IS NOT NULL THEN s.t_start_ns - pr.t_ns
                                       ELSE 0 END, 0) AS queue_ns
                       FROM c JOIN stp s ON s.run = c.run AND s.pid = c.pid AND s.step = c.step
                       LEFT JOIN stp ps ON ps.run = c.run AND ps.pid = c.pid AND ps.step = c.prev_step
                       LEFT JOIN swait w ON w.run = c.run AND w.pid = c.pid AND w.step = c.step
                       LEFT JOIN arr ar ON ar.run = c.run AND ar.pid = c.pid AND ar.request = c.request
                       LEFT JOIN pre pr ON pr.run = c.run AND pr.pid = c.pid AND pr.request = c.request
                                       AND pr.attempt = c.attempt)
                     SELECT t.*, queue_ns + sched_ns + storage_ns + compute_ns AS total_ns,
                       CASE WHEN storage_ns > compute_ns AND storage_ns >= queue_ns + sched_ns THEN 'storage'
                            WHEN queue_ns + sched_ns > compute_ns AND queue_ns + sched_ns > storage_ns THEN 'queueing'
                            WHEN attempt > 0 THEN 'recompute'
                            ELSE 'compute' END AS verdict
                     FROM t"""),
    ]


def _reuse_views() -> list[tuple[str, str]]:
    """Evictions against later references, in-flight sharing, and per-request loads."""
    return [
        # each eviction paired with the next admission whose prompt needs that block again
        ("reref", """WITH refs AS (
                       SELECT a.run, a.pid, a.request, a.attempt, a.step, pb.idx, pb.hash, a.cached_local,
                              a.cached_external, z.bs
                       FROM adm a JOIN pblock pb ON pb.run = a.run AND pb.pid = a.pid AND pb.request = a.request
                       JOIN bsz z ON z.run = a.run AND z.pid = a.pid
                       WHERE z.bs > 0 AND pb.idx < CAST(FLOOR((a.prefill_len - 1) / z.bs) AS BIGINT)),
                     ev AS (SELECT run, pid, step, t_ns, block_hash, grp,
                            ROW_NUMBER() OVER (ORDER BY run, pid, step, t_ns, block_hash, grp) AS eid FROM evict),
                     nx AS (SELECT e.eid, MIN(r.step) AS ref_step FROM ev e JOIN refs r ON r.run = e.run
                            AND r.pid = e.pid AND r.hash = e.block_hash AND r.step > e.step GROUP BY e.eid),
                     pick AS (
                       SELECT e.eid, e.run, e.grp, e.step AS ev_step, e.t_ns AS ev_t, r.request, r.attempt, r.step AS ref_step,
                              r.idx, r.bs, r.cached_local, r.cached_external, s.t_start_ns AS ref_t,
                              ROW_NUMBER() OVER (PARTITION BY e.eid ORDER BY r.request, r.attempt) AS rn
                       FROM ev e JOIN nx ON nx.eid = e.eid
                       JOIN refs r ON r.run = e.run AND r.pid = e.pid AND r.hash = e.block_hash AND r.step = nx.ref_step
                       JOIN stp s ON s.run = r.run AND s.pid = r.pid AND s.step = r.step)
                     SELECT eid, run, grp, ev_step, ev_t, ref_step, ref_t, ref_t - ev_t AS dt_ns, ref_step - ev_step AS dsteps,
                       idx, bs, request, attempt,
                       CASE WHEN idx * bs < cached_local THEN 'restored'
                            WHEN idx * bs < cached_local + cached_external THEN 'reloaded'
                            ELSE 'lost' END AS outcome
                     FROM pick WHERE rn = 1"""),
        # first admissions with their hit and hittable blocks, and the requests in flight when they
        # were admitted that share their first block (chained hashes: any shared block implies it)
        ("ifadm", """SELECT a.run, a.pid, a.request, a.step, z.bs,
                     CAST(FLOOR((a.cached_local + a.cached_external) / z.bs) AS BIGINT) AS hitb,
                     CAST(FLOOR((a.prompt_len - 1) / z.bs) AS BIGINT) AS cap
                     FROM adm a JOIN bsz z ON z.run = a.run AND z.pid = a.pid WHERE a.attempt = 0 AND z.bs > 0"""),
        ("ifpairs", """WITH p0 AS (SELECT DISTINCT run, pid, request, hash FROM pblock WHERE idx = 0)
                     SELECT DISTINCT b.run, b.pid, b.request, o.request AS other
                     FROM ifadm b JOIN p0 x ON x.run = b.run AND x.pid = b.pid AND x.request = b.request
                     JOIN p0 o ON o.run = x.run AND o.pid = x.pid AND o.hash = x.hash AND o.request <> x.request
                     JOIN span s ON s.run = o.run AND s.pid = o.pid AND s.request = o.request
                     WHERE s.first_step < b.step AND s.last_step > b.step"""),
        ("loads", """SELECT run, request, COUNT(*) AS n, SUM(t_end_ns - t_start_ns) AS load_ns, SUM(blocks) AS blocks,
                     SUM(nbytes) AS bytes FROM kv_load WHERE request IS NOT NULL AND request <> ''
                     GROUP BY run, request"""),
    ]


SIZE_BUCKET = ("CASE WHEN {x} <= 32 THEN 32 WHEN {x} <= 64 THEN 64 WHEN {x} <= 128 THEN 128 WHEN {x} <= 256 THEN 256 "
               "WHEN {x} <= 512 THEN 512 WHEN {x} <= 1024 THEN 1024 WHEN {x} <= 2048 THEN 2048 "
               "WHEN {x} <= 4096 THEN 4096 WHEN {x} <= 8192 THEN 8192 ELSE 16384 END")
DT_BUCKET = ("CASE WHEN {x} < 1000000 THEN '<1ms' WHEN {x} < 10000000 THEN '1-10ms' WHEN {x} < 100000000 THEN '10-100ms' "
             "WHEN {x} < 1000000000 THEN '0.1-1s' WHEN {x} < 10000000000 THEN '1-10s' ELSE '>=10s' END")

# latency buckets (upper edge in µs; 1000000 = above 100 ms)
LAT_BUCKET = ("CASE WHEN {x} < 50000 THEN 50 WHEN {x} < 100000 THEN 100 WHEN {x} < 200000 THEN 200 "
              "WHEN {x} < 500000 THEN 500 WHEN {x} < 1000000 THEN 1000 WHEN {x} < 2000000 THEN 2000 "
              "WHEN {x} < 5000000 THEN 5000 WHEN {x} < 10000000 THEN 10000 WHEN {x} < 20000000 THEN 20000 "
              "WHEN {x} < 50000000 THEN 50000 WHEN {x} < 100000000 THEN 100000 ELSE 1000000 END")

SLOW_CHUNKS = 10
# the SLOW_CHUNKS slowest chunks (total time; ties by run, step, request, attempt), ranked from 1
SLOW = f"""slow AS (SELECT * FROM (SELECT c.run, c.request, c.attempt, c.chunk_index, c.step, c.t_start_ns, c.t_end_ns,
          c.total_ns, c.storage_ns, c.compute_ns, c.verdict, ROW_NUMBER() OVER (
          ORDER BY c.total_ns DESC, c.run, c.step, c.request, c.attempt) AS rk FROM ctime c) t WHERE rk <= {SLOW_CHUNKS})"""

FIGURES: dict[str, str] = {
    # ---- KV reuse, counted at first admission only ----
    "hit_overall": """SELECT COUNT(*) AS requests, COALESCE(SUM(prompt_len), 0) AS prompt_tokens,
        COALESCE(SUM(cached_local), 0) AS hit_local, COALESCE(SUM(cached_external), 0) AS hit_external
        FROM adm WHERE attempt = 0""",
    "readmit": """SELECT COUNT(*) AS readmissions, COALESCE(SUM(cached_local + cached_external), 0) AS reused_tokens,
        COALESCE(SUM(prefill_len - tok_start), 0) AS recomputed_tokens FROM adm WHERE attempt > 0""",
    "later_chunks": """SELECT COUNT(*) AS chunks, COALESCE(SUM(tok_len), 0) AS tokens FROM chk
        WHERE attempt = 0 AND chunk_index > 0""",
    "hit_requests": """SELECT a.run, a.request, a.step, a.prompt_len, a.cached_local, a.cached_external,
        COALESCE(r.n, 0) AS readmissions, COALESCE(r.reused, 0) AS readmit_reused
        FROM adm a LEFT JOIN (SELECT run, pid, request, COUNT(*) AS n, SUM(cached_local + cached_external) AS reused
                              FROM adm WHERE attempt > 0 GROUP BY run, pid, request) r
          ON r.run = a.run AND r.pid = a.pid AND r.request = a.request
        WHERE a.attempt = 0 ORDER BY a.run, a.step, a.request""",
    "hit_by_index": """SELECT c.chunk_index, COUNT(*) AS chunks, SUM(c.tok_len) AS computed,
        SUM(CASE WHEN c.chunk_index = 0 THEN a.cached_local + a.cached_external ELSE 0 END) AS hit
        FROM chk c JOIN adm a ON a.run = c.run AND a.pid = c.pid AND a.request = c.request AND a.attempt = c.attempt
        WHERE c.attempt = 0 GROUP BY c.chunk_index ORDER BY c.chunk_index""",
    "hit_by_size": f"""SELECT bucket, COUNT(*) AS requests, SUM(prompt_len) AS prompt_tokens,
        SUM(cached_local + cached_external) AS hit FROM (
          SELECT a.prompt_len, a.cached_local, a.cached_external, {SIZE_BUCKET.format(x='c.tok_len')} AS bucket
          FROM adm a JOIN chk c ON c.run = a.run AND c.pid = a.pid AND c.request = a.request AND c.attempt = a.attempt
          AND c.chunk_index = 0 WHERE a.attempt = 0) t GROUP BY bucket ORDER BY bucket""",
    # ---- chunking versus blocks ----
    "block_size": "SELECT run, pid, bs FROM bsz ORDER BY run, pid",
    # per engine (EngineCore process: a data-parallel rank) of each run: its first admissions, hits, evictions
    "engines": """SELECT a.run, a.pid AS engine_pid, COUNT(*) AS requests, SUM(a.prompt_len) AS prompt_tokens,
        SUM(a.cached_local + a.cached_external) AS hit_tokens, SUM(a.cached_external) AS external_tokens,
        COALESCE(MAX(e.n), 0) AS evictions
        FROM adm a LEFT JOIN (SELECT run, pid, COUNT(*) AS n FROM evict GROUP BY run, pid) e ON e.run = a.run AND e.pid = a.pid
        WHERE a.attempt = 0 GROUP BY a.run, a.pid ORDER BY a.run, a.pid""",
    "server": "SELECT name, version, MAX(block_size) AS block_size FROM engine GROUP BY name, version ORDER BY name, version",
    "partial_blocks": """SELECT COUNT(*) AS chunks_not_last,
        COALESCE(SUM(CASE WHEN (c.tok_start + c.tok_len) % b.bs <> 0 THEN 1 ELSE 0 END), 0) AS mid_block_ends,
        COALESCE(SUM((c.tok_start + c.tok_len) % b.bs), 0) AS partial_tokens
        FROM chk c JOIN bsz b ON b.run = c.run AND b.pid = c.pid WHERE c.is_last = 0 AND b.bs > 0""",
    "prompt_tails": """SELECT COUNT(*) AS requests, COALESCE(SUM(CASE WHEN a.prompt_len % b.bs <> 0 THEN 1 ELSE 0 END), 0)
        AS with_tail, COALESCE(SUM(a.prompt_len % b.bs), 0) AS tail_tokens
        FROM adm a JOIN bsz b ON b.run = a.run AND b.pid = a.pid WHERE a.attempt = 0 AND b.bs > 0""",
    "inflight": """WITH common AS (
          SELECT pr.run, pr.pid, pr.request, pr.other, COUNT(*) AS blocks
          FROM ifpairs pr JOIN pblock pb ON pb.run = pr.run AND pb.pid = pr.pid AND pb.request = pr.request
          JOIN pblock pa ON pa.run = pb.run AND pa.pid = pb.pid AND pa.request = pr.other AND pa.idx = pb.idx
                        AND pa.hash = pb.hash
          GROUP BY pr.run, pr.pid, pr.request, pr.other),
        best AS (SELECT run, pid, request, MAX(blocks) AS blocks, COUNT(*) AS suppliers FROM common
                 GROUP BY run, pid, request)
        SELECT b.run, b.request, b.step, b.hitb AS hit_blocks, x.blocks AS shared_blocks, x.suppliers,
               (LEAST(x.blocks, b.cap) - b.hitb) * b.bs AS missed_tokens
        FROM ifadm b JOIN best x ON x.run = b.run AND x.pid = b.pid AND x.request = b.request
        WHERE LEAST(x.blocks, b.cap) > b.hitb ORDER BY b.run, b.step, b.request""",
    "evictions": "SELECT COUNT(*) AS evictions FROM evict",
    "reref_outcome": """SELECT outcome, COUNT(*) AS blocks, SUM(bs) AS tokens FROM reref GROUP BY outcome ORDER BY outcome""",
    # a hybrid model's KV cache groups evict on their own (one eviction per group's copy)
    "evict_groups": """SELECT e.grp AS kv_group, COUNT(*) AS evictions,
        COALESCE(MAX(r.rereferenced), 0) AS rereferenced, COALESCE(MAX(r.lost), 0) AS thrash_blocks,
        COALESCE(MAX(r.lost_tokens), 0) AS thrash_tokens
        FROM evict e LEFT JOIN (SELECT grp, COUNT(*) AS rereferenced,
                                       SUM(CASE WHEN outcome = 'lost' THEN 1 ELSE 0 END) AS lost,
                                       SUM(CASE WHEN outcome = 'lost' THEN bs ELSE 0 END) AS lost_tokens
                                FROM reref GROUP BY grp) r ON r.grp = e.grp
        GROUP BY e.grp ORDER BY e.grp""",
    "reref_dist": f"""SELECT COUNT(*) AS n, {pct('dt_ns', 'dt', (0.5, 0.9, 0.99))}, {pct('dsteps', 'steps', (0.5, 0.9))},
        MIN(dt_ns) AS dt_min, MAX(dt_ns) AS dt_max FROM reref""",
    "reref_hist": f"""SELECT bucket, outcome, COUNT(*) AS blocks FROM (SELECT {DT_BUCKET.format(x='dt_ns')} AS bucket, outcome
        FROM reref) t GROUP BY bucket, outcome ORDER BY bucket, outcome""",
    # ---- why tokens missed (token_causes, kvtrace.correlate.causes) ----
    "causes_total": """SELECT CASE WHEN attempt = 0 THEN 'first' ELSE 'readmission' END AS admission, cause,
        COUNT(DISTINCT run || ' ' || request || ' ' || CAST(attempt AS STRING)) AS admissions, SUM(tokens) AS tokens
        FROM token_causes GROUP BY CASE WHEN attempt = 0 THEN 'first' ELSE 'readmission' END, cause
        ORDER BY admission, cause""",
    "causes_requests": f"""SELECT run, request, SUM(tokens) AS prompt_len, {CAUSE_COLUMNS}
        FROM token_causes WHERE attempt = 0 GROUP BY run, request ORDER BY run, request""",
    "causes_by_index": """SELECT c.chunk_index, t.cause,
        SUM(LEAST(t.seg_end, c.tok_start + c.tok_len) - GREATEST(t.seg_start, c.tok_start)) AS tokens
        FROM chk c JOIN token_causes t ON t.run = c.run AND t.pid = c.pid AND t.request = c.request
          AND t.attempt = c.attempt AND t.seg_start < c.tok_start + c.tok_len AND t.seg_end > c.tok_start
        WHERE c.attempt = 0 AND t.cause NOT LIKE 'hit%'
        GROUP BY c.chunk_index, t.cause ORDER BY c.chunk_index, t.cause""",
    "evicted_misses": f"""SELECT COUNT(*) AS blocks, SUM(tokens) AS tokens, {pct('distance_blocks', 'dblocks', (0.5, 0.9))},
        {pct('distance_ns', 'dt', (0.5, 0.9))}, COUNT(DISTINCT evicted_by) AS evicting_requests
        FROM token_causes WHERE cause = 'miss_evicted' AND block_hash <> 0""",
    # ---- time per chunk ----
    "chunk_time": """SELECT COUNT(*) AS chunks, COALESCE(SUM(queue_ns), 0) AS queue_ns, COALESCE(SUM(sched_ns), 0) AS sched_ns,
        COALESCE(SUM(storage_ns), 0) AS storage_ns, COALESCE(SUM(compute_ns), 0) AS compute_ns,
        COALESCE(SUM(CASE WHEN attempt > 0 THEN compute_ns ELSE 0 END), 0) AS recompute_ns,
        COALESCE(SUM(CASE WHEN storage_ns > 0 THEN 1 ELSE 0 END), 0) AS chunks_waiting FROM ctime""",
    "chunk_verdicts": "SELECT verdict, COUNT(*) AS chunks, SUM(total_ns) AS total_ns FROM ctime GROUP BY verdict ORDER BY verdict",
    "chunks": """SELECT run, request, attempt, chunk_index, step, tok_start, tok_len, is_last, t_start_ns, t_end_ns,
        queue_ns, sched_ns, storage_ns, compute_ns, total_ns, verdict FROM ctime
        ORDER BY run, step, request, attempt""",
    # ---- storage ----
    "block_io": f"""SELECT disk, op, SUM(COALESCE(NULLIF(weight, 0), 1)) AS ios, SUM(bytes * COALESCE(NULLIF(weight, 0), 1)) AS bytes, MIN(start_ns) AS t0,
        MAX(ts_ns) AS t1, SUM(latency_ns * COALESCE(NULLIF(weight, 0), 1)) AS busy_ns, {pct('latency_ns', 'lat')}, MAX(latency_ns) AS lat_max,
        {pct('queue_ns', 'queue', (0.5,))}, {pct('device_ns', 'device', (0.5,))}
        FROM block_io WHERE error = 0 OR error IS NULL GROUP BY disk, op ORDER BY disk, op""",
    "nvme": f"""SELECT ctrl, qid, transport, opclass, COUNT(*) AS samples,
        SUM(COALESCE(NULLIF(weight, 0), 1)) AS commands, SUM(bytes * COALESCE(NULLIF(weight, 0), 1)) AS bytes,
        MIN(ts_ns - latency_ns) AS t0, MAX(ts_ns) AS t1, SUM(latency_ns * COALESCE(NULLIF(weight, 0), 1)) AS busy_ns,
        AVG(CAST(sq_occupancy AS DOUBLE)) AS sq_avg, {pct('latency_ns', 'lat')}, MAX(latency_ns) AS lat_max
        FROM nvme_cmd GROUP BY ctrl, qid, transport, opclass ORDER BY ctrl, qid, transport, opclass""",
    "file_reads": f"""SELECT dir, SUM(w) AS reads, SUM(bytes * w) AS bytes, MIN(start_ns) AS t0, MAX(ts_ns) AS t1,
        SUM(latency_ns * w) AS busy_ns, {pct('latency_ns', 'lat')}, MAX(latency_ns) AS lat_max FROM fread
        GROUP BY dir ORDER BY dir""",
    # the traced processes' page-cache fills and faults on mapped files (probe filemap), per kind
    "mapped_files": """SELECT op, COUNT(*) AS files, SUM(events) AS events, SUM(pages) AS pages FROM (
        SELECT op, dev_major, dev_minor, ino, COUNT(*) AS events, SUM(pages) AS pages FROM file_map
        GROUP BY op, dev_major, dev_minor, ino) t GROUP BY op ORDER BY op""",
    "kv_transfers": f"""SELECT direction, kind, source, COUNT(*) AS n, SUM(blocks) AS blocks, SUM(nbytes) AS bytes,
        SUM(t_end_ns - t_start_ns) AS busy_ns, {pct('t_end_ns - t_start_ns', 'lat')} FROM (
          SELECT 'load' AS direction, CASE WHEN request <> '' THEN 'per request' ELSE 'per step' END AS kind,
                 source, blocks, nbytes, t_start_ns, t_end_ns FROM kv_load
          UNION ALL
          SELECT 'store' AS direction, CASE WHEN request <> '' THEN 'per request' ELSE 'per step' END AS kind,
                 source, blocks, nbytes, t_start_ns, t_end_ns FROM kv_store) t
        GROUP BY direction, kind, source ORDER BY direction, kind, source""",
    "nic_slow": """WITH cs AS (SELECT DISTINCT run, step, t_start_ns, t_end_ns, t_end_ns - t_start_ns AS d FROM ctime),
        thr AS (SELECT percentile_disc(0.9) WITHIN GROUP (ORDER BY d) AS p90 FROM cs),
        slow AS (SELECT cs.t_start_ns, cs.t_end_ns FROM cs, thr WHERE cs.d >= thr.p90),
        during AS (SELECT n.device, n.name, SUM(n.delta) AS delta FROM nic_counters n JOIN slow s
                   ON n.ts_ns > s.t_start_ns AND n.ts_ns - n.interval_ns < s.t_end_ns GROUP BY n.device, n.name),
        alln AS (SELECT device, name, SUM(delta) AS delta, MIN(ts_ns - interval_ns) AS t0, MAX(ts_ns) AS t1
                 FROM nic_counters GROUP BY device, name)
        SELECT a.device, a.name, a.delta AS total, COALESCE(d.delta, 0) AS during_slow, a.t0, a.t1,
               (SELECT COUNT(*) FROM slow) AS slow_steps, (SELECT SUM(t_end_ns - t_start_ns) FROM slow) AS slow_ns
        FROM alln a LEFT JOIN during d ON d.device = a.device AND d.name = a.name
        WHERE a.delta > 0 ORDER BY a.device, a.name""",
    # ---- the slowest chunks with the NVMe commands and NIC counters of their step's window ----
    "slow_chunks": f"""WITH {SLOW} SELECT rk, run, request, attempt, chunk_index, step, t_start_ns, t_end_ns, total_ns,
        storage_ns, compute_ns, verdict FROM slow ORDER BY rk""",
    "slow_nvme": f"""WITH {SLOW} SELECT s.rk, n.ctrl, n.qid, n.transport, SUM(COALESCE(NULLIF(n.weight, 0), 1)) AS commands,
        SUM(n.bytes * COALESCE(NULLIF(n.weight, 0), 1)) AS bytes,
        SUM(n.latency_ns * COALESCE(NULLIF(n.weight, 0), 1)) AS latency_sum_ns, MAX(n.latency_ns) AS latency_max_ns
        FROM slow s JOIN nvme_cmd n ON n.ts_ns >= s.t_start_ns AND n.ts_ns - n.latency_ns <= s.t_end_ns
        GROUP BY s.rk, n.ctrl, n.qid, n.transport ORDER BY s.rk, n.ctrl, n.qid, n.transport""",
    "slow_nic": f"""WITH {SLOW} SELECT s.rk, n.device, n.name, SUM(n.delta) AS delta
        FROM slow s JOIN nic_counters n ON n.ts_ns > s.t_start_ns AND n.ts_ns - n.interval_ns < s.t_end_ns
        GROUP BY s.rk, n.device, n.name HAVING SUM(n.delta) <> 0 ORDER BY s.rk, n.device, n.name""",
    "lat_hist": f"""SELECT source, device, bucket, SUM(w) AS n FROM (
          SELECT 'block' AS source, disk AS device, {LAT_BUCKET.format(x='latency_ns')} AS bucket, COALESCE(NULLIF(weight, 0), 1) AS w FROM block_io
          WHERE op = 'R' AND (error = 0 OR error IS NULL)
          UNION ALL SELECT 'nvme' AS source, ctrl || ' q' || CAST(qid AS STRING) AS device,
                 {LAT_BUCKET.format(x='latency_ns')} AS bucket, COALESCE(NULLIF(weight, 0), 1) AS w FROM nvme_cmd
          WHERE latency_ns IS NOT NULL
          UNION ALL SELECT 'file' AS source, dir AS device, {LAT_BUCKET.format(x='latency_ns')} AS bucket, w FROM fread
          UNION ALL SELECT 'kv_load' AS source, source AS device, {LAT_BUCKET.format(x='t_end_ns - t_start_ns')} AS bucket,
          1 AS w FROM kv_load WHERE request <> '') t GROUP BY source, device, bucket ORDER BY source, device, bucket""",
    # ---- reload versus recompute ----
    "reload": """SELECT COUNT(*) AS requests, COALESCE(SUM(l.n), 0) AS loads, COALESCE(SUM(l.load_ns), 0) AS load_ns,
        COALESCE(SUM(l.blocks), 0) AS blocks, COALESCE(SUM(l.blocks * z.bs), 0) AS tokens, COALESCE(SUM(l.bytes), 0) AS bytes
        FROM loads l JOIN (SELECT run, MAX(bs) AS bs FROM bsz GROUP BY run) z ON z.run = l.run""",
    "recompute": """SELECT COALESCE(SUM(CASE WHEN s.decode_tokens = 0 THEN s.exec_ns - COALESCE(w.wait_ns, 0) ELSE 0 END), 0) AS pure_ns,
        COALESCE(SUM(CASE WHEN s.decode_tokens = 0 THEN s.prefill_tokens ELSE 0 END), 0) AS pure_tokens,
        COALESCE(SUM(CASE WHEN s.decode_tokens = 0 THEN 1 ELSE 0 END), 0) AS pure_steps,
        COALESCE(SUM(s.exec_ns - COALESCE(w.wait_ns, 0)), 0) AS all_ns, COALESCE(SUM(s.total_tokens), 0) AS all_tokens,
        COUNT(*) AS steps
        FROM stp s LEFT JOIN swait w ON w.run = s.run AND w.pid = s.pid AND w.step = s.step WHERE s.prefill_tokens > 0""",
    "reload_chunks": """SELECT c.run, c.request, c.attempt, c.chunk_index, c.step, c.tok_len, c.step_tokens, c.compute_ns,
        c.storage_ns, SUM(l.t_end_ns - l.t_start_ns) AS load_ns, SUM(l.blocks) AS blocks, MAX(z.bs) AS bs
        FROM ctime c JOIN kv_load l ON l.run = c.run AND l.request = c.request AND l.t_start_ns >= c.t_start_ns
          AND l.t_start_ns < c.t_end_ns
        JOIN bsz z ON z.run = c.run AND z.pid = c.pid
        GROUP BY c.run, c.request, c.attempt, c.chunk_index, c.step, c.tok_len, c.step_tokens, c.compute_ns, c.storage_ns
        ORDER BY c.run, c.step, c.request""",
    # ---- prefetch opportunity ----
    "prefetch": """WITH lb AS (SELECT CASE WHEN SUM(blocks) > 0 THEN CAST(SUM(t_end_ns - t_start_ns) AS DOUBLE) / SUM(blocks)
                                   ELSE NULL END AS per_block_ns
                            FROM kv_load WHERE request <> '' AND blocks > 0)
        SELECT r.outcome, COUNT(*) AS blocks, MAX(lb.per_block_ns) AS per_block_ns,
               SUM(CASE WHEN CAST(r.dt_ns AS DOUBLE) >= lb.per_block_ns THEN 1 ELSE 0 END) AS blocks_with_time,
               SUM(LEAST(CAST(r.dt_ns AS DOUBLE), lb.per_block_ns)) AS hideable_ns
        FROM reref r CROSS JOIN lb GROUP BY r.outcome ORDER BY r.outcome""",
    "prefetch_arrival": """SELECT COUNT(*) AS requests, COALESCE(SUM(l.load_ns), 0) AS load_ns,
        COALESCE(SUM(LEAST(l.load_ns, c.queue_ns)), 0) AS hideable_ns
        FROM loads l JOIN ctime c ON c.run = l.run AND c.request = l.request AND c.attempt = 0 AND c.chunk_index = 0""",
    # ---- service ----
    "ttft": f"""WITH fl AS (SELECT run, pid, request, MIN(step) AS step FROM chk WHERE is_last = 1 GROUP BY run, pid, request),
        t AS (SELECT a.run, a.request, s.t_end_ns - COALESCE(ar.t_ns, fs.t_start_ns) AS ttft_ns,
                     CASE WHEN ar.t_ns IS NULL THEN 0 ELSE 1 END AS from_arrival
              FROM adm a JOIN fl ON fl.run = a.run AND fl.pid = a.pid AND fl.request = a.request
              JOIN stp s ON s.run = fl.run AND s.pid = fl.pid AND s.step = fl.step
              JOIN span sp ON sp.run = a.run AND sp.pid = a.pid AND sp.request = a.request
              JOIN stp fs ON fs.run = sp.run AND fs.pid = sp.pid AND fs.step = sp.first_step
              LEFT JOIN arr ar ON ar.run = a.run AND ar.pid = a.pid AND ar.request = a.request
              WHERE a.attempt = 0)
        SELECT COUNT(*) AS requests, SUM(from_arrival) AS from_arrival, {pct('ttft_ns', 'ttft', (0.5, 0.9, 0.99))},
               MAX(ttft_ns) AS ttft_max, SUM(ttft_ns) AS ttft_sum FROM t""",
    "ttft_requests": """WITH fl AS (SELECT run, pid, request, MIN(step) AS step FROM chk WHERE is_last = 1 GROUP BY run, pid, request)
        SELECT a.run, a.request, s.t_end_ns - COALESCE(ar.t_ns, fs.t_start_ns) AS ttft_ns
        FROM adm a JOIN fl ON fl.run = a.run AND fl.pid = a.pid AND fl.request = a.request
        JOIN stp s ON s.run = fl.run AND s.pid = fl.pid AND s.step = fl.step
        JOIN span sp ON sp.run = a.run AND sp.pid = a.pid AND sp.request = a.request
        JOIN stp fs ON fs.run = sp.run AND fs.pid = sp.pid AND fs.step = sp.first_step
        LEFT JOIN arr ar ON ar.run = a.run AND ar.pid = a.pid AND ar.request = a.request
        WHERE a.attempt = 0 ORDER BY a.run, a.request""",
    "window": """SELECT run, pid, MIN(t_start_ns) AS t0, MAX(t_end_ns) AS t1, COUNT(*) AS steps,
        SUM(decode_tokens) AS decode_tokens, SUM(prefill_tokens) AS prefill_tokens, SUM(preempted) AS preemptions,
        SUM(evicted) AS evicted FROM stp GROUP BY run, pid ORDER BY run, pid""",
    "first_tokens": "SELECT COUNT(*) AS n FROM chk WHERE is_last = 1",
    # speculative decoding: each step's draft tokens once (a step's scheduled decode tokens count
    # them), the accepted ones, and the requests' own counts at their finish
    "spec": """SELECT COUNT(*) AS steps, COALESCE(SUM(drafts), 0) AS drafts, COALESCE(SUM(accepted), 0) AS accepted,
        COALESCE(SUM(kept), 0) AS kept, COALESCE(SUM(generated), 0) AS generated FROM (
        SELECT DISTINCT run, pid, step, drafts, accepted, kept, generated FROM spec_step) t""",
    "spec_requests": """SELECT COUNT(*) AS requests, COALESCE(SUM(drafts), 0) AS drafts,
        COALESCE(SUM(accepted), 0) AS accepted, COALESCE(SUM(output_tokens), 0) AS output_tokens FROM (
        SELECT DISTINCT run, pid, request, drafts, accepted, output_tokens FROM spec_req) t""",
    "read_bytes": f"""SELECT (SELECT COALESCE(SUM(nbytes), 0) FROM kv_load WHERE request <> '') AS kv_load_bytes,
        (SELECT COALESCE(SUM(bytes * COALESCE(NULLIF(weight, 0), 1)), 0) FROM block_io WHERE op = 'R' AND (error = 0 OR error IS NULL)) AS block_read_bytes,
        (SELECT COALESCE(SUM(bytes * w), 0) FROM fread) AS file_read_bytes""",
    # the rise of each counter the report compares with the hook's, per server kind
    "metrics": """WITH m AS (SELECT run, COALESCE(server, 0) AS server, kind, ts_ns, name, SUM(value) AS v FROM server_metrics
          WHERE name IN (
          'vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total', 'vllm:external_prefix_cache_hits_total',
          'vllm:external_prefix_cache_queries_total', 'vllm:num_preemptions_total', 'sglang:cached_tokens_total',
          'sglang:prompt_tokens_total', 'sglang:num_retracted_requests_total', 'sglang:evicted_tokens_total')
          GROUP BY run, COALESCE(server, 0), kind, ts_ns, name)
        SELECT kind, name, SUM(rise) AS rise, SUM(scrapes) AS scrapes FROM (
          SELECT run, server, kind, name, MAX(v) - MIN(v) AS rise, COUNT(*) AS scrapes FROM m
          GROUP BY run, server, kind, name) t
        GROUP BY kind, name ORDER BY COALESCE(kind, ''), name""",
    # ---- the KV connector as the scheduler sees it, and vLLM's hit counters against kvtrace's ----
    **connector.FIGURES,
    # ---- a KV tier's own server: which tier served each prompt token, and each hop's cost ----
    **tier.FIGURES,
    **fleet.FIGURES,
    **handover.FIGURES,
}
