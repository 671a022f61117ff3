/* filemap.bpf.c: reads through mmap.  A process that maps a file and touches it (safetensors,
 * numpy memmap, a KV connector's mapped files) makes no read system call: its pages come in by
 * page faults, which the fileio probe never sees.  The page cache's own tracepoints name the
 * file (device, inode) and its pages:
 *
 *   filemap:mm_filemap_add_to_page_cache   a folio of 2^order pages from index added to the
 *                                          page cache in the process's context: read in by its
 *                                          fault's (or read's) readahead, or made for its write
 *   filemap:mm_filemap_fault               the faulting page (kernel 6.10 on)
 *   filemap:mm_filemap_map_pages           fault-around: pages [index, last_index] already in
 *                                          the page cache, mapped at once (kernel 6.10 on).  A
 *                                          large folio is mapped whole (PMD-sized; since 6.18
 *                                          any that fits) with this event still naming the
 *                                          fault-around window only: a lower bound
 *
 * Only the traced processes' events are recorded.  The block layer's rows (blockio) carry the
 * disk reads behind the fills. */

#include "kvtrace.h"

#define KV_FILEMAP_FAULT 1
#define KV_FILEMAP_MAP   2
#define KV_FILEMAP_FILL  3

struct kv_filemap_event {
    struct kv_hdr h;
    u64 ino;
    u64 index;            /* first page (in PAGE_SIZE units) */
    u64 last;             /* last page, included */
    u32 dev;              /* the kernel's dev_t: major << 20 | minor */
    u32 op;               /* KV_FILEMAP_* */
};

static __always_inline int kv_filemap(u32 op, u64 ino, u32 dev, u64 index, u64 last)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!kv_is_target(id >> 32))
        return 0;
    struct kv_filemap_event *e = events.ringbuf_reserve(sizeof(struct kv_filemap_event));
    if (!e) {
        kv_count_lost(KV_KIND_FILEMAP);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_FILEMAP, sizeof(*e), id >> 32, (u32)id);
    e->ino = ino;
    e->index = index;
    e->last = last;
    e->dev = dev;
    e->op = op;
    kv_submit(e, sizeof(*e));
    return 0;
}

TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache)
{
    u64 pages = 1ULL << (args->order & 31);
    return kv_filemap(KV_FILEMAP_FILL, args->i_ino, args->s_dev, args->index, args->index + pages - 1);
}

#ifdef KV_HAVE_FILEMAP_FAULT
TRACEPOINT_PROBE(filemap, mm_filemap_fault)
{
    return kv_filemap(KV_FILEMAP_FAULT, args->i_ino, args->s_dev, args->index, args->index);
}

TRACEPOINT_PROBE(filemap, mm_filemap_map_pages)
{
    return kv_filemap(KV_FILEMAP_MAP, args->i_ino, args->s_dev, args->index, args->last_index);
}
#endif
