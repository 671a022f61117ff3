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
/* Failed ring-buffer reserves, per kind: the ring buffer has no lost callback. */
BPF_PERCPU_ARRAY(lost, u64, KV_NKINDS);
/* Processes being traced (by tgid); children are added at fork. */
BPF_HASH(targets, u32, u8, KV_MAX_TARGETS);

static __always_inline int kv_is_target(u32 tgid)
{
    return targets.lookup(&tgid) != NULL;
}

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

#endif /* KVTRACE_H */
