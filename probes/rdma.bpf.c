/* rdma.bpf.c: kernel RDMA as kernel ULPs (nvme-rdma, nvmet-rdma, iSER, NFS/RDMA) drive it,
 * and RDMA connection management for every user (librdmacm too):
 *
 *   rdma_cma:cm_*        connection events (request, reply, established, rejected,
 *                        disconnect, QP create/destroy) with addresses and status
 *   rdma_core:cq_*       CQ alloc/free/modify as events; CQ polling counted per CQ in a map
 *                        (polls, completions, polls that used the whole budget, wake-ups and
 *                        their irq->poll latency) read by user space once per flush
 *
 * Kernel-bypass RDMA (user verbs, UCX, NIXL, GPUDirect) posts and polls from user space
 * against mapped queues: none of it reaches these tracepoints; see NIC counters.
 * Each tracepoint is compiled only where the kernel has it (KV_RDMA_TP_<event>).
 */

#include "kvtrace.h"

#define KV_RDMA_CM_EVENT_HANDLER 1
#define KV_RDMA_CM_EVENT_DONE 2
#define KV_RDMA_CM_SEND_REQ 3
#define KV_RDMA_CM_SEND_REP 4
#define KV_RDMA_CM_SEND_RTU 5
#define KV_RDMA_CM_SEND_REJ 6
#define KV_RDMA_CM_DISCONNECT 7
#define KV_RDMA_CM_SENT_DREQ 8
#define KV_RDMA_CM_SENT_DREP 9
#define KV_RDMA_CM_ID_DESTROY 10
#define KV_RDMA_CM_QP_CREATE 11
#define KV_RDMA_CM_QP_DESTROY 12
#define KV_RDMA_CM_REQ_HANDLER 13
#define KV_RDMA_CM_SEND_MRA 14
#define KV_RDMA_CQ_ALLOC 20
#define KV_RDMA_CQ_ALLOC_ERROR 21
#define KV_RDMA_CQ_FREE 22
#define KV_RDMA_CQ_MODIFY 23

struct kv_rdma_event {
    struct kv_hdr h;
    u32 id;                /* cm_id / cq_id (restrack ids: `rdma resource show`) */
    u32 type;              /* KV_RDMA_* */
    s32 status;            /* event status, consumer result, rc */
    u32 event;             /* rdma_cm_event_type (or ib_cm_event_type for cm_req_handler) */
    u32 tos;
    u32 qp_num;
    u32 a;                 /* cq: nr_cqe / comps;  qp_create: pd_id */
    u32 b;                 /* cq: comp_vector / usec;  qp_create: send_wr */
    u32 c;                 /* cq: poll_ctx;  qp_create: recv_wr */
    u32 d;                 /* qp_create: qp_type */
    u8  srcaddr[28];       /* struct sockaddr_in6 storage (sockaddr_in for IPv4) */
    u8  dstaddr[28];
    char comm[16];
};

struct kv_rdma_cqstat {
    u64 polls;
    u64 completions;
    u64 full_polls;        /* polls that returned the whole budget: a backlog */
    u64 wakeups;           /* cq_process */
    u64 wakeup_lat_us;     /* sum of irq/reschedule -> processing latency */
    u64 wakeup_lat_max_us;
    u64 interrupts;        /* cq_schedule (from the completion interrupt) */
    u64 reschedules;       /* cq_reschedule */
};

BPF_HASH(rdma_cq, u32, struct kv_rdma_cqstat, 4096);

static __always_inline struct kv_rdma_event *kv_rdma_new(u32 type, u32 id)
{
    struct kv_rdma_event *e = events.ringbuf_reserve(sizeof(struct kv_rdma_event));
    if (!e) {
        kv_count_lost(KV_KIND_RDMA);
        return NULL;
    }
    u64 pt = bpf_get_current_pid_tgid();
    kv_fill_hdr(&e->h, KV_KIND_RDMA, sizeof(*e), pt >> 32, (u32)pt);
    __builtin_memset((char *)e + sizeof(struct kv_hdr), 0, sizeof(*e) - sizeof(struct kv_hdr));
    e->type = type;
    e->id = id;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    return e;
}

static __always_inline void kv_rdma_addrs(struct kv_rdma_event *e, const void *src, const void *dst)
{
    bpf_probe_read_kernel(e->srcaddr, sizeof(e->srcaddr), src);
    bpf_probe_read_kernel(e->dstaddr, sizeof(e->dstaddr), dst);
}

static __always_inline struct kv_rdma_cqstat *kv_rdma_cq(u32 cq_id)
{
    struct kv_rdma_cqstat zero = {};
    return rdma_cq.lookup_or_try_init(&cq_id, &zero);
}

#ifdef KV_RDMA_TP_CM_EVENT_HANDLER
TRACEPOINT_PROBE(rdma_cma, cm_event_handler)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_EVENT_HANDLER, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->event = args->event;
    e->status = args->status;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_EVENT_DONE
TRACEPOINT_PROBE(rdma_cma, cm_event_done)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_EVENT_DONE, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->event = args->event;
    e->status = args->result;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_REQ_HANDLER
TRACEPOINT_PROBE(rdma_cma, cm_req_handler)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_REQ_HANDLER, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->event = args->event;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SEND_REQ
TRACEPOINT_PROBE(rdma_cma, cm_send_req)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SEND_REQ, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->qp_num = args->qp_num;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SEND_REP
TRACEPOINT_PROBE(rdma_cma, cm_send_rep)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SEND_REP, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->qp_num = args->qp_num;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_QP_DESTROY
TRACEPOINT_PROBE(rdma_cma, cm_qp_destroy)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_QP_DESTROY, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->qp_num = args->qp_num;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SEND_RTU
TRACEPOINT_PROBE(rdma_cma, cm_send_rtu)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SEND_RTU, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SEND_REJ
TRACEPOINT_PROBE(rdma_cma, cm_send_rej)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SEND_REJ, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SEND_MRA
TRACEPOINT_PROBE(rdma_cma, cm_send_mra)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SEND_MRA, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_DISCONNECT
TRACEPOINT_PROBE(rdma_cma, cm_disconnect)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_DISCONNECT, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SENT_DREP
TRACEPOINT_PROBE(rdma_cma, cm_sent_drep)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SENT_DREP, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_SENT_DREQ
TRACEPOINT_PROBE(rdma_cma, cm_sent_dreq)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_SENT_DREQ, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_ID_DESTROY
TRACEPOINT_PROBE(rdma_cma, cm_id_destroy)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_ID_DESTROY, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CM_QP_CREATE
TRACEPOINT_PROBE(rdma_cma, cm_qp_create)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CM_QP_CREATE, args->cm_id);
    if (!e)
        return 0;
    e->tos = args->tos;
    e->qp_num = args->qp_num;
    e->status = args->rc;
    e->a = args->pd_id;
    e->b = args->send_wr;
    e->c = args->recv_wr;
    e->d = args->qp_type;
    kv_rdma_addrs(e, args->srcaddr, args->dstaddr);
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_ALLOC
TRACEPOINT_PROBE(rdma_core, cq_alloc)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CQ_ALLOC, args->cq_id);
    if (!e)
        return 0;
    e->a = args->nr_cqe;
    e->b = args->comp_vector;
    e->c = args->poll_ctx;
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_ALLOC_ERROR
TRACEPOINT_PROBE(rdma_core, cq_alloc_error)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CQ_ALLOC_ERROR, 0);
    if (!e)
        return 0;
    e->status = args->rc;
    e->a = args->nr_cqe;
    e->b = args->comp_vector;
    e->c = args->poll_ctx;
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_FREE
TRACEPOINT_PROBE(rdma_core, cq_free)
{
    u32 id = args->cq_id;
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CQ_FREE, id);
    if (e)
        kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_MODIFY
TRACEPOINT_PROBE(rdma_core, cq_modify)
{
    struct kv_rdma_event *e = kv_rdma_new(KV_RDMA_CQ_MODIFY, args->cq_id);
    if (!e)
        return 0;
    e->a = args->comps;
    e->b = args->usec;
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_POLL
TRACEPOINT_PROBE(rdma_core, cq_poll)
{
    struct kv_rdma_cqstat *s = kv_rdma_cq(args->cq_id);
    if (!s)
        return 0;
    int rc = args->rc, req = args->requested;
    __sync_fetch_and_add(&s->polls, 1);
    if (rc > 0)
        __sync_fetch_and_add(&s->completions, rc);
    if (rc > 0 && rc == req)
        __sync_fetch_and_add(&s->full_polls, 1);
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_PROCESS
TRACEPOINT_PROBE(rdma_core, cq_process)
{
    struct kv_rdma_cqstat *s = kv_rdma_cq(args->cq_id);
    if (!s)
        return 0;
    s64 lat = args->latency;
    __sync_fetch_and_add(&s->wakeups, 1);
    if (lat > 0) {
        __sync_fetch_and_add(&s->wakeup_lat_us, lat);
        if ((u64)lat > s->wakeup_lat_max_us)
            s->wakeup_lat_max_us = lat;
    }
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_SCHEDULE
TRACEPOINT_PROBE(rdma_core, cq_schedule)
{
    struct kv_rdma_cqstat *s = kv_rdma_cq(args->cq_id);
    if (s)
        __sync_fetch_and_add(&s->interrupts, 1);
    return 0;
}
#endif

#ifdef KV_RDMA_TP_CQ_RESCHEDULE
TRACEPOINT_PROBE(rdma_core, cq_reschedule)
{
    struct kv_rdma_cqstat *s = kv_rdma_cq(args->cq_id);
    if (s)
        __sync_fetch_and_add(&s->reschedules, 1);
    return 0;
}
#endif
