/* proc.bpf.c: follow the traced processes: children forked later join the target set,
 * and forks and exits are recorded so the dataset knows the process tree. */

#include "kvtrace.h"

struct kv_proc_event {
    struct kv_hdr h;
    u32 child;      /* new task id (fork) or 0 */
    u32 op;         /* 1 fork, 2 exit (thread-group leader) */
    char comm[16];
};

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!kv_is_target(tgid))
        return 0;
    u32 child = args->child_pid;
    u8 one = 1;
    /* A new thread's id lands here too; it is harmless, lookups are by tgid. */
    targets.update(&child, &one);
    struct kv_proc_event *e = events.ringbuf_reserve(sizeof(struct kv_proc_event));
    if (!e) {
        kv_count_lost(KV_KIND_PROC);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_PROC, sizeof(*e), tgid, (u32)id);
    e->child = child;
    e->op = 1;
    bpf_get_current_comm(e->comm, sizeof(e->comm)); /* a child starts with its parent's comm */ 
    kv_submit(e, sizeof(*e));
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    if (tid != tgid) {
        targets.delete(&tid);   /* a thread added at clone time, if any */
        return 0;
    }
    if (!kv_is_target(tgid))
        return 0;
    targets.delete(&tgid);
    struct kv_proc_event *e = events.ringbuf_reserve(sizeof(struct kv_proc_event));
    if (!e) {
        kv_count_lost(KV_KIND_PROC);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_PROC, sizeof(*e), tgid, tid);
    e->child = 0;
    e->op = 2;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    kv_submit(e, sizeof(*e));
    return 0;
}
