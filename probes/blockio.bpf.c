/* blockio.bpf.c: one event per block request issued by a traced process.
 *
 * The submitter is only known where the request starts (completion runs in irq or
 * softirq context), so the request is remembered at block_io_start (6.5+) or, on older
 * kernels, block_bio_queue, keyed by (dev, sector), stamped at block_rq_issue, and
 * emitted at block_rq_complete with queue and device latency.  Partial completions emit
 * one event per completed part and re-key the remainder.  Each part is also counted in the
 * aggregation maps (kvtrace.h) per (pid, device, op) before the raw event is sampled.
 *
 * The request's size is taken at block_rq_issue (bios merged into it after it started are
 * included).  Before 6.5 the bio is remembered where it was queued: a bio remapped to another
 * device before it becomes a request (a native-multipath head to its path, dm) is followed
 * through block_bio_remap, and the record of a bio merged into an earlier request is dropped
 * at block_bio_backmerge (the request's own record carries it).
 */

#include "kvtrace.h"

#define KV_BLOCKIO_DEFINED 1   /* nvme.bpf.c looks submitters up in block_start */

struct kv_block_key {
    u64 sector;
    u32 dev;
    u32 pad;
};

struct kv_block_start {
    u64 ts_start;
    u64 ts_issue;
    u32 tgid;
    u32 tid;
    u32 bytes;
    u32 from_dev;     /* the device the bio was queued on, when block_bio_remap moved it (else 0) */
    char rwbs[8];
    char comm[16];
};

struct kv_block_event {
    struct kv_hdr h;
    u64 ts_start;
    u64 ts_issue;
    u64 sector;
    u32 dev;
    u32 bytes;
    s32 error;
    u32 weight;    /* events this one stands for (1 unless sampled) */
    char rwbs[8];
    char comm[16];
};

BPF_TABLE("lru_hash", struct kv_block_key, struct kv_block_start, block_start, KV_MAX_INFLIGHT);

/* error of a row whose request ended without its completion traced (decoded as no error and
 * no latency): the kernel can drop a tracepoint event before any BPF program runs for it, and
 * count it nowhere (measured: about one block_rq_complete in 50,000 at this VM's top rate) */
#define KV_BLOCK_UNSEEN (-2147483647 - 1)

/* One block_io record of the request st at k; 0 when the ring had no room (the caller
 * counts the loss). */
static __always_inline int kv_block_emit(struct kv_block_key *k, struct kv_block_start *st, u64 now,
                                         u32 bytes, s32 error, u32 weight)
{
    struct kv_block_event *e = events.ringbuf_reserve(sizeof(struct kv_block_event));
    if (!e)
        return 0;
    kv_fill_hdr(&e->h, KV_KIND_BLOCK, sizeof(*e), st->tgid, st->tid);
    e->h.ts = now;
    e->ts_start = st->ts_start;
    e->ts_issue = st->ts_issue;
    e->sector = k->sector;
    e->dev = k->dev ? k->dev : st->from_dev;   /* a path without any dev number: its head's */
    e->bytes = bytes;
    e->error = error;
    e->weight = weight;
    __builtin_memcpy(e->rwbs, st->rwbs, sizeof(e->rwbs));
    __builtin_memcpy(e->comm, st->comm, sizeof(e->comm));
    kv_submit(e, sizeof(*e));
    return 1;
}

static __always_inline int kv_block_remember(u32 dev, u64 sector, u32 bytes, const char *rwbs)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!kv_is_target(tgid))
        return 0;
    struct kv_block_key k = {};
    k.dev = dev;
    k.sector = sector;
    struct kv_block_start *old = block_start.lookup(&k);
    if (old && old->ts_issue) {
        /* a request the probe saw issued here never came back through block_rq_complete, and
         * a new one is starting: the old one has ended.  It becomes a row, so that it is not
         * overwritten unseen; not sampled, not aggregated (block_agg counts what the probe saw
         * complete), as rare as the drops */
        struct kv_block_start prev = *old;
        if (!kv_block_emit(&k, &prev, bpf_ktime_get_ns(), prev.bytes, KV_BLOCK_UNSEEN, 1))
            kv_sample_lost(KV_KIND_BLOCK, 1);
    }
    struct kv_block_start s = {};
    s.ts_start = bpf_ktime_get_ns();
    s.tgid = tgid;
    s.tid = (u32)id;
    s.bytes = bytes;
    bpf_probe_read_kernel(&s.rwbs, sizeof(s.rwbs), rwbs);
    bpf_get_current_comm(&s.comm, sizeof(s.comm));
    block_start.update(&k, &s);
    return 0;
}

#ifdef KV_HAVE_BLOCK_IO_START
TRACEPOINT_PROBE(block, block_io_start)
{
    return kv_block_remember(args->dev, args->sector, args->bytes, args->rwbs);
}
#else
TRACEPOINT_PROBE(block, block_bio_queue)
{
    return kv_block_remember(args->dev, args->sector, args->nr_sector << 9, args->rwbs);
}

#ifdef KV_HAVE_BIO_REMAP
/* dev a traced bio was remapped to -> the dev it came from: user space names a hidden
 * multipath path disk (a dev number but no /sys/dev/block link on 6.1) by its head. */
BPF_HASH(block_remaps, u32, u32, 1024);

/* A bio moved to another device before it became a request: a native-multipath head's bio
 * to the path disk, dm to the device below.  Its submitter goes with it.
 * (A partition remap comes before block_bio_queue, so there is nothing to carry.) */
TRACEPOINT_PROBE(block, block_bio_remap)
{
    struct kv_block_key from = {};
    from.dev = args->old_dev;
    from.sector = args->old_sector;
    struct kv_block_start *s = block_start.lookup(&from);
    if (!s)
        return 0;
    struct kv_block_start st = *s;
    block_start.delete(&from);
    if (!st.from_dev)
        st.from_dev = from.dev;
    struct kv_block_key to = {};
    to.dev = args->dev;
    to.sector = args->sector;
    block_start.update(&to, &st);
    if (to.dev != from.dev) {
        u32 *seen = block_remaps.lookup(&to.dev);
        if (!seen || *seen != from.dev)
            block_remaps.update(&to.dev, &from.dev);
    }
    return 0;
}
#endif

#ifdef KV_HAVE_BIO_BACKMERGE
/* A bio merged at the back of a request: the request (remembered at its first bio) is
 * counted whole at issue; the merged bio's own record would never be issued. */
TRACEPOINT_PROBE(block, block_bio_backmerge)
{
    struct kv_block_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    block_start.delete(&k);
    return 0;
}
#endif
#endif

/* The request's operation from its rwbs flags, as kvtrace/capture/blockio.py op_of(). */
static __always_inline u16 kv_block_op(const char *rwbs)
{
#pragma unroll
    for (int i = 0; i < 8; i++) {
        char c = rwbs[i];
        if (c == 0)
            break;
        if (c == 'R')
            return 0;
        if (c == 'W')
            return 1;
        if (c == 'D')
            return 2;
        if (c == 'F')
            return 3;
    }
    return 4;
}

TRACEPOINT_PROBE(block, block_rq_issue)
{
    struct kv_block_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    struct kv_block_start *s = block_start.lookup(&k);
    if (s && s->ts_issue == 0) {
        s->ts_issue = bpf_ktime_get_ns();
        u32 bytes = args->bytes;
        if (bytes == 0)
            bytes = args->nr_sector << 9;
        if (bytes)
            s->bytes = bytes;   /* the whole request: bios merged into it are included */
    }
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete)
{
    struct kv_block_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    struct kv_block_start *s = block_start.lookup(&k);
    if (!s)
        return 0;
    struct kv_block_start st = *s;
    block_start.delete(&k);
    u32 done = args->nr_sector << 9;
    if (done == 0 || done > st.bytes)
        done = st.bytes;
    if (done < st.bytes) {
        /* partial completion: the rest of the request continues at sector + done */
        struct kv_block_key rest = k;
        rest.sector = k.sector + (done >> 9);
        struct kv_block_start more = st;
        more.bytes = st.bytes - done;
        block_start.update(&rest, &more);
    }
    u64 now = bpf_ktime_get_ns();
    u64 queue = st.ts_issue ? st.ts_issue - st.ts_start : 0;
    u64 device = now - (st.ts_issue ? st.ts_issue : st.ts_start);
    int error = args->error;
    kv_aggregate(KV_KIND_BLOCK, st.tgid, k.dev, kv_block_op(st.rwbs), error ? 0 : done, error != 0,
                 now - st.ts_start, queue, device);
    u32 weight = kv_sample(KV_KIND_BLOCK);
    if (!weight)
        return 0;
    if (!kv_block_emit(&k, &st, now, done, error, weight)) {
        kv_sample_lost(KV_KIND_BLOCK, weight);
        return 0;
    }
    kv_sample_ok(KV_KIND_BLOCK);
    return 0;
}
