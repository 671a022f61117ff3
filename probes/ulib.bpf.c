/* ulib.bpf.c: user-space KV transfer libraries, by uprobes (opt-in: `--uprobe LIB`).
 *
 * Kernel-bypass RDMA (verbs, UCX, NIXL) and GPUDirect Storage move KV data without any
 * kernel tracepoint.  Their entry points can still be seen in the process:
 *
 *   UCX     ucp_put_nbx(ep, buffer, count, remote_addr, rkey, param)   bytes = count
 *           ucp_get_nbx(ep, buffer, count, remote_addr, rkey, param)   (non-blocking: the
 *           return is when the transfer was posted, not when it completed)
 *   cuFile  cuFileRead(fh, devPtr, size, file_offset, devPtr_offset)   bytes = size; blocking:
 *           cuFileWrite(...)                                          entry -> return is the I/O
 *   NIXL    nixlAgent::postXferReq(...)                                a post (bytes unknown)
 *
 * Entry is paired with return per thread; only traced processes are recorded.  The probes are
 * attached by kvtrace/fabric/session.py to the libraries the user names or the traced
 * processes have mapped.
 */

#include "kvtrace.h"

#define KV_ULIB_UCP_PUT      1
#define KV_ULIB_UCP_GET      2
#define KV_ULIB_CUFILE_READ  3
#define KV_ULIB_CUFILE_WRITE 4
#define KV_ULIB_NIXL_POST    5

struct kv_ulib_event {
    struct kv_hdr h;      /* ts: return */
    u64 ts_entry;
    u64 bytes;
    u64 arg;              /* UCX: remote address; cuFile: file offset */
    s64 ret;              /* return value (cuFile: bytes or -errno; UCX: status pointer) */
    u32 func;             /* KV_ULIB_* */
    u32 pad;
};

struct kv_ulib_start {
    u64 ts;
    u64 bytes;
    u64 arg;
};

struct kv_ulib_key {
    u32 tid;
    u32 func;
};

BPF_HASH(ulib_start, struct kv_ulib_key, struct kv_ulib_start, 16384);

static __always_inline int kv_ulib_entry(u32 func, u64 bytes, u64 arg)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!kv_is_target(id >> 32))
        return 0;
    struct kv_ulib_key k = {};
    k.tid = (u32)id;
    k.func = func;
    struct kv_ulib_start s = {};
    s.ts = bpf_ktime_get_ns();
    s.bytes = bytes;
    s.arg = arg;
    ulib_start.update(&k, &s);
    return 0;
}

static __always_inline int kv_ulib_return(struct pt_regs *ctx, u32 func)
{
    u64 id = bpf_get_current_pid_tgid();
    struct kv_ulib_key k = {};
    k.tid = (u32)id;
    k.func = func;
    struct kv_ulib_start *s = ulib_start.lookup(&k);
    if (!s)
        return 0;
    struct kv_ulib_start st = *s;
    ulib_start.delete(&k);
    struct kv_ulib_event *e = events.ringbuf_reserve(sizeof(struct kv_ulib_event));
    if (!e) {
        kv_count_lost(KV_KIND_ULIB);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_ULIB, sizeof(*e), id >> 32, (u32)id);
    e->ts_entry = st.ts;
    e->bytes = st.bytes;
    e->arg = st.arg;
    e->ret = (s64)PT_REGS_RC(ctx);
    e->func = func;
    e->pad = 0;
    kv_submit(e, sizeof(*e));
    return 0;
}

int kv_ulib_ucp_put(struct pt_regs *ctx) { return kv_ulib_entry(KV_ULIB_UCP_PUT, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)); }
int kv_ulib_ucp_put_ret(struct pt_regs *ctx) { return kv_ulib_return(ctx, KV_ULIB_UCP_PUT); }
int kv_ulib_ucp_get(struct pt_regs *ctx) { return kv_ulib_entry(KV_ULIB_UCP_GET, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)); }
int kv_ulib_ucp_get_ret(struct pt_regs *ctx) { return kv_ulib_return(ctx, KV_ULIB_UCP_GET); }
int kv_ulib_cufile_read(struct pt_regs *ctx) { return kv_ulib_entry(KV_ULIB_CUFILE_READ, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)); }
int kv_ulib_cufile_read_ret(struct pt_regs *ctx) { return kv_ulib_return(ctx, KV_ULIB_CUFILE_READ); }
int kv_ulib_cufile_write(struct pt_regs *ctx) { return kv_ulib_entry(KV_ULIB_CUFILE_WRITE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)); }
int kv_ulib_cufile_write_ret(struct pt_regs *ctx) { return kv_ulib_return(ctx, KV_ULIB_CUFILE_WRITE); }
int kv_ulib_nixl_post(struct pt_regs *ctx) { return kv_ulib_entry(KV_ULIB_NIXL_POST, 0, 0); }
int kv_ulib_nixl_post_ret(struct pt_regs *ctx) { return kv_ulib_return(ctx, KV_ULIB_NIXL_POST); }
