/* usermark.bpf.c: records from the kvtrace hook inside vLLM.
 *
 * The hook calls write(KV_MARK_FD, frame, len) with a negative fd; the call fails with
 * EBADF, but sys_enter_write sees it first and copies the frame (up to 4095 bytes) into the
 * shared ring buffer, on the same clock as every kernel event.  Reserve sizes are bucketed
 * because ring-buffer reservations must be constant-sized.  fileio.bpf.c also hooks
 * sys_enter_write (to trace writes); when both are loaded it calls kv_usermark_write first.
 */

#include "kvtrace.h"

#ifndef KV_MARK_FD
#define KV_MARK_FD -4242
#endif
#define KV_HAVE_USERMARK 1

struct kv_user_small { struct kv_hdr h; u32 len; u32 pad; u8 data[256]; };
struct kv_user_mid   { struct kv_hdr h; u32 len; u32 pad; u8 data[1024]; };
struct kv_user_big   { struct kv_hdr h; u32 len; u32 pad; u8 data[4096]; };

/* bcc cannot rewrite map calls inside macros, so one emitter per size, spelled out. */
static __always_inline void kv_user_small_emit(u64 id, const void *buf, u64 len)
{
    struct kv_user_small *e = events.ringbuf_reserve(sizeof(struct kv_user_small));
    if (!e) { kv_count_lost(KV_KIND_USER); return; }
    kv_fill_hdr(&e->h, KV_KIND_USER, sizeof(*e), id >> 32, (u32)id);
    u32 n = len & (sizeof(e->data) - 1);
    e->len = bpf_probe_read_user(e->data, n, buf) < 0 ? 0 : n;
    e->pad = 0;
    kv_submit(e, sizeof(*e));
}

static __always_inline void kv_user_mid_emit(u64 id, const void *buf, u64 len)
{
    struct kv_user_mid *e = events.ringbuf_reserve(sizeof(struct kv_user_mid));
    if (!e) { kv_count_lost(KV_KIND_USER); return; }
    kv_fill_hdr(&e->h, KV_KIND_USER, sizeof(*e), id >> 32, (u32)id);
    u32 n = len & (sizeof(e->data) - 1);
    e->len = bpf_probe_read_user(e->data, n, buf) < 0 ? 0 : n;
    e->pad = 0;
    kv_submit(e, sizeof(*e));
}

static __always_inline void kv_user_big_emit(u64 id, const void *buf, u64 len)
{
    struct kv_user_big *e = events.ringbuf_reserve(sizeof(struct kv_user_big));
    if (!e) { kv_count_lost(KV_KIND_USER); return; }
    kv_fill_hdr(&e->h, KV_KIND_USER, sizeof(*e), id >> 32, (u32)id);
    u32 n = len & (sizeof(e->data) - 1);
    e->len = bpf_probe_read_user(e->data, n, buf) < 0 ? 0 : n;
    e->pad = 0;
    kv_submit(e, sizeof(*e));
}

/* 1 when the write was a marker (consumed), 0 otherwise. */
static __always_inline int kv_usermark_write(int fd, const void *buf, u64 len)
{
    if (fd != KV_MARK_FD)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!kv_is_target(id >> 32))
        return 1;
    if (len < 256)
        kv_user_small_emit(id, buf, len);
    else if (len < 1024)
        kv_user_mid_emit(id, buf, len);
    else
        kv_user_big_emit(id, buf, len);
    return 1;
}

#ifndef KV_TRACE_WRITES
TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
    kv_usermark_write((int)args->fd, args->buf, args->count);
    return 0;
}
#endif
