/* kvtrace.h: event structs and helpers shared by every kvtrace probe.
 *
 * All probes are compiled into one BPF program, so kernel and user events share one
 * ring buffer and one clock (bpf_ktime_get_ns, CLOCK_MONOTONIC).  The Python mirror of
 * each struct lives in kvtrace/capture/<probe>.py; tests decode recorded bytes with it.
 * Layout rules: every struct starts with struct kv_hdr, fields are naturally aligned,
 * sizes are multiples of 8.
 */
#ifndef KVTRACE_H
#define KVTRACE_H

#include <uapi/linux/ptrace.h>
#include <linux/sched.h>
#include <linux/fs.h>   /* rwf_t, used by the preadv2/pwritev2 tracepoint structs */

#define KV_KIND_BLOCK    1
#define KV_KIND_FILEIO   2
#define KV_KIND_FDOPEN   3
#define KV_KIND_URING    4
#define KV_KIND_PROC     5
#define KV_KIND_USER     6
#define KV_KIND_NVME     7
#define KV_KIND_TCP      8
#define KV_KIND_RDMA     9
#define KV_KIND_ULIB     10
#define KV_KIND_FILEMAP  11
#define KV_NKINDS        16

#ifndef KV_RINGBUF_PAGES
#define KV_RINGBUF_PAGES 1024
#endif
#ifndef KV_MAX_TARGETS
#define KV_MAX_TARGETS 4096
#endif
#ifndef KV_MAX_INFLIGHT
#define KV_MAX_INFLIGHT 65536
#endif

struct kv_hdr {
    u8  kind;       /* KV_KIND_*: first byte, the decoder dispatches on it */
    u8  version;    /* layout version of this kind */
    u16 size;       /* sizeof the whole event */
    u32 cpu;
    u64 ts;         /* bpf_ktime_get_ns() when the event was emitted */
    u32 tgid;
    u32 tid;
};

BPF_RINGBUF_OUTPUT(events, KV_RINGBUF_PAGES);
/* Wakeups.  The agent reads the ring buffer on a timer (kvtrace/capture/loader.py), so a record
 * needs no wakeup of its own: with one per record, the agent was woken hundreds of times a
 * second onto a CPU the traced server was using.  Records are submitted with BPF_RB_NO_WAKEUP
 * while the bytes submitted since the reader last zeroed rb_unread stay under KV_WAKE_BYTES (a
 * quarter of the ring); past that every submit wakes the reader, so a burst is read before it
 * can fill the ring. */
#ifndef KV_WAKE_BYTES
#define KV_WAKE_BYTES ((u64)KV_RINGBUF_PAGES * PAGE_SIZE / 4)
#endif
BPF_ARRAY(rb_unread, u64, 1);

static __always_inline u64 kv_wake_flags(u64 size)
{
    int zero = 0;
    u64 *n = rb_unread.lookup(&zero);
    if (!n)
        return BPF_RB_FORCE_WAKEUP;
    __sync_fetch_and_add(n, size);
    return *n >= KV_WAKE_BYTES ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* Submit a reserved record of this size (every probe uses this, never ringbuf_submit(e, 0)). */
static __always_inline void kv_submit(void *e, u64 size)
{
    events.ringbuf_submit(e, kv_wake_flags(size));
}
/* Failed ring-buffer reserves, per kind: the ring buffer has no lost callback. */
BPF_PERCPU_ARRAY(lost, u64, KV_NKINDS);
/* Processes being traced (by tgid); children are added at fork. */
BPF_HASH(targets, u32, u8, KV_MAX_TARGETS);

static __always_inline int kv_is_target(u32 tgid)
{
    return targets.lookup(&tgid) != NULL;
}

#ifdef KV_FD_SKIP
/* File descriptors of traced processes that are not files (sockets, pipes, eventfds, epoll
 * and timer fds: a serving process reads and writes them all the time), put here by
 * fdopen.bpf.c when a call that makes one returns it, else by user space once /proc says what
 * they are (kvtrace/capture/fdskip.py); fileio.bpf.c skips their
 * reads and writes.  Any close, dup onto, or open returning the number takes it out, so a
 * file opened on a reused number is traced.  LRU: an eviction only means tracing again. */
struct kv_fd_key {
    u32 tgid;
    s32 fd;
};
BPF_TABLE("lru_hash", struct kv_fd_key, u8, fd_skip, 65536);

static __always_inline struct kv_fd_key kv_fd_key(u32 tgid, s64 fd)
{
    struct kv_fd_key k = {};
    k.tgid = tgid;
    k.fd = (s32)fd;
    return k;
}

static __always_inline void kv_fd_forget(u32 tgid, s64 fd)
{
    if (fd < 0)
        return;
    struct kv_fd_key k = kv_fd_key(tgid, fd);
    fd_skip.delete(&k);
}
#endif

static __always_inline void kv_count_lost(u32 kind)
{
    u64 *c = lost.lookup(&kind);
    if (c)
        (*c)++;
}

static __always_inline void kv_fill_hdr(struct kv_hdr *h, u8 kind, u16 size, u32 tgid, u32 tid)
{
    h->kind = kind;
    h->version = 1;
    h->size = size;
    h->cpu = bpf_get_smp_processor_id();
    h->ts = bpf_ktime_get_ns();
    h->tgid = tgid;
    h->tid = tid;
}

/* ---- In-kernel aggregation and raw-event sampling (block, file, io_uring) ----------------
 *
 * Every completed block request, file read/write call and io_uring request of a traced
 * process is counted in agg_stats (count, bytes, errors, latency sums) and agg_hist (log2
 * latency buckets), keyed by (kind, pid, device, op), before any ring-buffer reserve: these
 * maps stay exact at any rate.  User space reads them each flush (kvtrace/capture/agg.py).
 *
 * Raw events of these kinds are sampled 1 in 2^shift (sample_cfg[kind].shift; 0 keeps
 * all), with the weight 2^shift in each event.  In auto mode a failed reserve raises the
 * shift at once, at most once per KV_SAMPLE_RAISE_NS and only when the reader drained the
 * ring since the last raise (a stalled reader is not helped by sparser sampling); user
 * space lowers it again once failures stop.  Failed reserves are counted in lost (events)
 * and lost_weight (the events they stood for).
 */
#ifndef KV_AGG_ENTRIES
#define KV_AGG_ENTRIES 8192
#endif
#ifndef KV_AGG_HIST_ENTRIES
#define KV_AGG_HIST_ENTRIES 32768
#endif
#define KV_SAMPLE_MAX_SHIFT 15          /* weights fit in u16 */
#define KV_SAMPLE_RAISE_NS  10000000ULL /* 10 ms */

struct kv_agg_key {
    u32 tgid;
    u32 dev;       /* block: dev_t (major << 20 | minor); 0 otherwise */
    u16 op;        /* block: 0 R, 1 W, 2 D, 3 F, 4 other; file: KV_SYS_*; io_uring: opcode */
    u8  kind;      /* KV_KIND_* */
    u8  slot;      /* agg_hist only: latency in [2^(slot-1), 2^slot) ns; 0 in agg_stats */
};

struct kv_agg_val {
    u64 count;
    u64 bytes;     /* block: of requests without error; file: sum of ret > 0; io_uring: res > 0 of data ops */
    u64 errors;    /* block: error != 0; file: ret < 0; io_uring: res < 0 */
    u64 latency_ns;
    u64 sum2;      /* block: queue time; file: bytes asked for (non-vector calls) */
    u64 sum3;      /* block: device time */
};

struct kv_sample_cfg {
    u32 shift;       /* keep 1 in 2^shift raw events of this kind */
    u32 auto_raise;  /* 1: a failed reserve raises shift */
    u64 last_raise;  /* bpf_ktime_get_ns() of the last raise */
    u32 drained;     /* a reserve succeeded since the last raise */
    u32 raises;      /* raises done in the kernel */
};

BPF_HASH(agg_stats, struct kv_agg_key, struct kv_agg_val, KV_AGG_ENTRIES);
BPF_HASH(agg_hist, struct kv_agg_key, u64, KV_AGG_HIST_ENTRIES);
/* Accounting that could not be done, per kind: [kind] agg_stats full, [16 + kind] agg_hist full. */
BPF_ARRAY(agg_drops, u64, 2 * KV_NKINDS);
BPF_ARRAY(sample_cfg, struct kv_sample_cfg, KV_NKINDS);
BPF_PERCPU_ARRAY(sample_seq, u64, KV_NKINDS);
BPF_PERCPU_ARRAY(lost_weight, u64, KV_NKINDS);

static __always_inline void kv_agg_drop(u32 i)
{
    u64 *d = agg_drops.lookup(&i);
    if (d)
        __sync_fetch_and_add(d, 1);
}

static __always_inline void kv_aggregate(u8 kind, u32 tgid, u32 dev, u16 op, u64 bytes, u64 error,
                                         u64 lat, u64 sum2, u64 sum3)
{
    struct kv_agg_key k = {};
    k.tgid = tgid;
    k.dev = dev;
    k.op = op;
    k.kind = kind;
    struct kv_agg_val zero = {};
    struct kv_agg_val *v = agg_stats.lookup_or_try_init(&k, &zero);
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        if (bytes)
            __sync_fetch_and_add(&v->bytes, bytes);
        if (error)
            __sync_fetch_and_add(&v->errors, 1);
        __sync_fetch_and_add(&v->latency_ns, lat);
        if (sum2)
            __sync_fetch_and_add(&v->sum2, sum2);
        if (sum3)
            __sync_fetch_and_add(&v->sum3, sum3);
    } else {
        kv_agg_drop(kind);
    }
    k.slot = lat ? bpf_log2l(lat) : 0;   /* bcc's bpf_log2l(v) = floor(log2 v) + 1 */
    u64 hzero = 0;
    u64 *h = agg_hist.lookup_or_try_init(&k, &hzero);
    if (h)
        __sync_fetch_and_add(h, 1);
    else
        kv_agg_drop(KV_NKINDS + kind);
}

/* The weight of this raw event (2^shift), or 0 when sampling leaves it out. */
static __always_inline u32 kv_sample(u32 kind)
{
    struct kv_sample_cfg *c = sample_cfg.lookup(&kind);
    if (!c || c->shift == 0)
        return 1;
    u32 shift = c->shift;
    if (shift > KV_SAMPLE_MAX_SHIFT)
        shift = KV_SAMPLE_MAX_SHIFT;
    u64 *seq = sample_seq.lookup(&kind);
    if (!seq)
        return 1;
    u64 n = *seq;
    *seq = n + 1;
    if (n & ((1ULL << shift) - 1))
        return 0;
    return 1U << shift;
}

/* A reserve of kind succeeded: the reader is draining the ring. */
static __always_inline void kv_sample_ok(u32 kind)
{
    struct kv_sample_cfg *c = sample_cfg.lookup(&kind);
    if (c && c->auto_raise && !c->drained)
        c->drained = 1;
}

/* A reserve of kind failed: count it, and in auto mode sample more sparsely. */
static __always_inline void kv_sample_lost(u32 kind, u32 weight)
{
    kv_count_lost(kind);
    u64 *w = lost_weight.lookup(&kind);
    if (w)
        *w += weight;
    struct kv_sample_cfg *c = sample_cfg.lookup(&kind);
    if (!c || !c->auto_raise || !c->drained || c->shift >= KV_SAMPLE_MAX_SHIFT)
        return;
    u64 now = bpf_ktime_get_ns();
    if (now - c->last_raise < KV_SAMPLE_RAISE_NS)
        return;
    c->last_raise = now;
    c->drained = 0;
    __sync_fetch_and_add(&c->shift, 1);
    __sync_fetch_and_add(&c->raises, 1);
}

#endif /* KVTRACE_H */
