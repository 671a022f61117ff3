/* nvme.bpf.c: NVMe commands per controller and queue (PCIe, TCP, RDMA, FC, loop alike).
 *
 * nvme:nvme_setup_cmd is paired with nvme:nvme_complete_rq on (ctrl_id, qid, cid & 0xfff):
 * the upper 4 bits of a command id are a generation counter that setup always carries and
 * complete carries only since 6.0 (before, complete reports the bare tag).  Every completion
 * is counted exactly in two maps read by user space once per flush (per-queue totals and
 * log2 latency histograms, per operation class), so accounting stays complete at any rate;
 * per-command events go to the ring buffer, sampled under load with the weight each stands
 * for, while errors, retries and slow commands are always emitted.
 *
 * The issuing thread: completion runs in irq/softirq/kworker context, so the issuer is taken
 * at setup, from the block layer's record of the request (blockio.bpf.c, keyed by device and
 * sector, filled in the submitter's context) when that probe is compiled in and user space
 * told us the namespace's devices, else from the task running the setup (often the
 * submitter; a kworker when dispatch was deferred) - the event says which.
 *
 * All argument structs come from the tracepoint format files (TRACEPOINT_PROBE), so field
 * offsets that differ across kernels and vendor trees are absorbed at compile time; fields
 * that do not exist everywhere are behind KV_NVME_HAVE_* (set by kvtrace/capture/nvme.py).
 */

#include "kvtrace.h"

#define KV_NVME_OP_READ     0
#define KV_NVME_OP_WRITE    1
#define KV_NVME_OP_FLUSH    2
#define KV_NVME_OP_OTHER    3   /* other I/O command (DSM, write zeroes, zone ops, ...) */
#define KV_NVME_OP_ADMIN    4   /* any command on the admin queue (qid 0) */
#define KV_NVME_OP_FABRICS  5   /* fabrics command (opcode 0x7f: connect, property get/set) */
#define KV_NVME_OP_UNKNOWN  6   /* completion without a setup seen (counts unmatched) */
#define KV_NVME_OP_QUEUE    7   /* per-queue rows that belong to no command class (SQ occupancy) */

#define KV_NVME_REC_CMD     0
#define KV_NVME_REC_AEN     1
#define KV_NVME_REC_UNSEEN  2   /* a command that ended without its completion traced (see nvme_setup_cmd) */

#define KV_NVME_ISSUER_NONE  0
#define KV_NVME_ISSUER_BLOCK 1
#define KV_NVME_ISSUER_SETUP 2

/* xflags */
#define KV_NVME_X_NS_UNKNOWN 0x1  /* the namespace was not in nvme_ns at setup: bytes = nlb << 9,
                                     the issuer is the setup's task (user space corrects the bytes) */

#define KV_NVME_MODE_SAMPLED 0   /* adaptive sampling within cfg.budget per CPU per window */
#define KV_NVME_MODE_ALL     1   /* every command */
#define KV_NVME_MODE_NONE    2   /* no per-command events, only errors/slow/retries and the maps */

#define KV_NVME_WINDOW_NS   100000000ULL   /* sampling window per CPU: 100 ms */
#define KV_NVME_MAX_SHIFT   24

#ifndef KV_NVME_HIST_ENTRIES
#define KV_NVME_HIST_ENTRIES 65536
#endif
#ifndef KV_NVME_QUEUE_ENTRIES
#define KV_NVME_QUEUE_ENTRIES 8192
#endif

struct kv_nvme_key {
    u32 ctrl_id;
    u16 qid;
    u16 tag;            /* cid & 0xfff */
};

struct kv_nvme_start {
    u64 ts;
    u64 slba;
    u32 nsid;
    u32 nlb;
    u32 bytes;
    u32 tgid;
    u32 tid;
    u32 setup_tid;
    u16 cid;
    u8  opcode;
    u8  fctype;
    u8  flags;
    u8  issuer;
    u8  xflags;         /* KV_NVME_X_* */
    u8  pad;
    char comm[16];
};

struct kv_nvme_event {
    struct kv_hdr h;      /* tgid/tid: the issuer (see issuer), ts: completion */
    u64 ts_setup;
    u64 slba;
    u64 result;           /* AEN: the async event result dword */
    u32 ctrl_id;
    u32 nsid;
    u32 nlb;              /* logical blocks of LBA commands (0 otherwise) */
    u32 bytes;            /* data bytes of read/write/compare/zone append */
    u32 weight;           /* commands this event stands for (1 = every one, 2^k when sampled) */
    u16 qid;
    u16 cid;              /* command id at setup (generation counter included) */
    u16 status;           /* nvme_req(req)->status: SC | SCT<<8 | CRD<<11 | M<<13 | DNR<<14 */
    u16 sq_occ;           /* PCIe: SQ occupancy at the last CQE of the queue; 0xffff unknown */
    u8  opcode;
    u8  fctype;
    u8  flags;
    u8  retries;
    u8  rec;              /* KV_NVME_REC_* */
    u8  issuer;           /* KV_NVME_ISSUER_* */
    u8  opclass;          /* KV_NVME_OP_* */
    u8  xflags;           /* KV_NVME_X_* */
    u32 setup_tid;        /* thread the setup ran on */
    char disk[32];
    char comm[16];
};

struct kv_nvme_qkey {
    u32 ctrl_id;
    u16 qid;
    u8  opclass;
    u8  pad;
};

struct kv_nvme_hkey {
    u32 ctrl_id;
    u16 qid;
    u8  opclass;
    u8  slot;             /* bits of the latency in ns: [2^(slot-1), 2^slot) */
};

struct kv_nvme_qstat {
    u64 setups;
    u64 completions;
    u64 bytes;            /* of successful data commands */
    u64 latency_ns;       /* sum over completions */
    u64 errors;           /* status != 0 */
    u64 retried;          /* completions with retries > 0 */
    u64 unmatched;        /* completions whose setup was not seen */
    u64 unseen;           /* of completions: commands that ended without the probe seeing it */
    u64 sq_samples;
    u64 sq_occ_sum;
    u32 sq_occ_max;       /* the largest occupancy seen in flush interval sq_epoch */
    u32 sq_epoch;
};

struct kv_nvme_nskey {
    u32 ctrl_id;
    u32 nsid;
};

/* Data commands of namespaces nvme_ns did not know yet, whose bytes were counted as
 * nlb << 9: their blocks per (controller, namespace, queue, op class), so user space can
 * add what 512-byte LBAs left out once the topology says the LBA size. */
struct kv_nvme_fkey {
    u32 ctrl_id;
    u32 nsid;
    u16 qid;
    u8  opclass;
    u8  pad;
};

/* Filled by user space from sysfs (kvtrace/fabric/topology.py). */
struct kv_nvme_ns {
    u32 dev1;             /* block-layer dev of the disk the controller's requests are on (0 for hidden path disks) */
    u32 dev2;             /* the multipath head's dev (bios are queued there), or 0 */
    u32 lba_shift;        /* log2 of the logical block size */
    u32 pad;
};

struct kv_nvme_cfg {
    u64 slow_ns;          /* completions at least this slow are always emitted (0: never forced) */
    u32 budget;           /* sampled mode: events per CPU per 100 ms window */
    u32 mode;             /* KV_NVME_MODE_* */
    u32 epoch;            /* flush interval number (user space bumps it after each read) */
    u32 pad;
};

struct kv_nvme_rate {
    u64 win_start;
    u32 seen;
    u32 shift;
};

BPF_TABLE("lru_hash", struct kv_nvme_key, struct kv_nvme_start, nvme_start, KV_MAX_INFLIGHT);
BPF_HASH(nvme_qstats, struct kv_nvme_qkey, struct kv_nvme_qstat, KV_NVME_QUEUE_ENTRIES);
BPF_HASH(nvme_hist, struct kv_nvme_hkey, u64, KV_NVME_HIST_ENTRIES);
BPF_HASH(nvme_ns, struct kv_nvme_nskey, struct kv_nvme_ns, 4096);
BPF_HASH(nvme_lbafix, struct kv_nvme_fkey, u64, KV_NVME_QUEUE_ENTRIES);   /* -> blocks (nlb) */
BPF_HASH(nvme_qdepth, u32, u32, 1024);               /* ctrl_id -> I/O queue depth (PCIe) */
BPF_HASH(nvme_sqocc, struct kv_nvme_qkey, u32, KV_NVME_QUEUE_ENTRIES);
BPF_ARRAY(nvme_cfg, struct kv_nvme_cfg, 1);
BPF_PERCPU_ARRAY(nvme_rate, struct kv_nvme_rate, 1);
/* Accounting that could not be done: [0] queue map full, [1] histogram map full,
 * [2] nvme_lbafix full (those bytes stay counted in 512-byte LBAs). */
BPF_ARRAY(nvme_drops, u64, 4);

static __always_inline u8 kv_nvme_opclass(int qid, u8 opcode)
{
    if (opcode == 0x7f)
        return KV_NVME_OP_FABRICS;
    if (qid == 0)
        return KV_NVME_OP_ADMIN;
    if (opcode == 0x02)
        return KV_NVME_OP_READ;
    if (opcode == 0x01)
        return KV_NVME_OP_WRITE;
    if (opcode == 0x00)
        return KV_NVME_OP_FLUSH;
    return KV_NVME_OP_OTHER;
}

/* NVM command set commands whose cdw10-12 carry SLBA and NLB. */
static __always_inline int kv_nvme_is_lba_cmd(u8 opcode)
{
    return opcode == 0x01 || opcode == 0x02 || opcode == 0x04 || opcode == 0x05 ||
           opcode == 0x08 || opcode == 0x0c || opcode == 0x7d;
}

/* ...and those that move data (the rest: write uncorrectable, write zeroes, verify). */
static __always_inline int kv_nvme_moves_data(u8 opcode)
{
    return opcode == 0x01 || opcode == 0x02 || opcode == 0x05 || opcode == 0x7d;
}

static __always_inline struct kv_nvme_qstat *kv_nvme_qstat(u32 ctrl_id, u16 qid, u8 opclass)
{
    struct kv_nvme_qkey k = {};
    k.ctrl_id = ctrl_id;
    k.qid = qid;
    k.opclass = opclass;
    struct kv_nvme_qstat zero = {};
    struct kv_nvme_qstat *q = nvme_qstats.lookup_or_try_init(&k, &zero);
    if (!q) {
        u32 i = 0;
        u64 *d = nvme_drops.lookup(&i);
        if (d)
            __sync_fetch_and_add(d, 1);
    }
    return q;
}

/* One command ended: its totals (seen: its completion was traced, with this status and
 * latency; else it ended untraced, counted in `unseen` with its bytes as if successful). */
static __always_inline void kv_nvme_count(struct kv_nvme_key *k, struct kv_nvme_start *st, u8 opclass,
                                          u16 status, u8 retries, u64 lat, int seen)
{
    struct kv_nvme_qstat *q = kv_nvme_qstat(k->ctrl_id, k->qid, opclass);
    if (!q)
        return;
    __sync_fetch_and_add(&q->completions, 1);
    if (seen)
        __sync_fetch_and_add(&q->latency_ns, lat);
    else
        __sync_fetch_and_add(&q->unseen, 1);
    if (status == 0) {
        __sync_fetch_and_add(&q->bytes, st->bytes);
        if ((st->xflags & KV_NVME_X_NS_UNKNOWN) && st->bytes) {
            struct kv_nvme_fkey fk = {};
            fk.ctrl_id = k->ctrl_id;
            fk.nsid = st->nsid;
            fk.qid = k->qid;
            fk.opclass = opclass;
            u64 fzero = 0;
            u64 *blocks = nvme_lbafix.lookup_or_try_init(&fk, &fzero);
            if (blocks) {
                __sync_fetch_and_add(blocks, st->nlb);
            } else {
                u32 i = 2;
                u64 *d = nvme_drops.lookup(&i);
                if (d)
                    __sync_fetch_and_add(d, 1);
            }
        }
    } else
        __sync_fetch_and_add(&q->errors, 1);
    if (retries)
        __sync_fetch_and_add(&q->retried, 1);
}

/* A per-command event reserved and filled from the setup record; the caller sets status,
 * flags, retries and disk, and submits it. */
static __always_inline struct kv_nvme_event *kv_nvme_event(struct kv_nvme_key *k, struct kv_nvme_start *st,
                                                           u64 now, u8 opclass, u8 rec, u32 weight)
{
    struct kv_nvme_event *e = events.ringbuf_reserve(sizeof(struct kv_nvme_event));
    if (!e) {
        kv_count_lost(KV_KIND_NVME);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_NVME, sizeof(*e), st->tgid, st->tid);
    e->h.ts = now;
    e->ts_setup = st->ts;
    e->slba = st->slba;
    e->result = 0;
    e->ctrl_id = k->ctrl_id;
    e->nsid = st->nsid;
    e->nlb = st->nlb;
    e->bytes = st->bytes;
    e->weight = weight;
    e->qid = k->qid;
    e->cid = st->cid;
    e->status = 0;
    e->sq_occ = 0xffff;
    struct kv_nvme_qkey ok = {};
    ok.ctrl_id = k->ctrl_id;
    ok.qid = k->qid;
    u32 *occ = nvme_sqocc.lookup(&ok);
    if (occ && rec == KV_NVME_REC_CMD)
        e->sq_occ = *occ;
    e->opcode = st->opcode;
    e->fctype = st->fctype;
    e->flags = 0;
    e->retries = 0;
    e->rec = rec;
    e->issuer = st->issuer;
    e->opclass = opclass;
    e->xflags = st->xflags;
    e->setup_tid = st->setup_tid;
    __builtin_memset(e->disk, 0, sizeof(e->disk));
    __builtin_memcpy(e->comm, st->comm, sizeof(e->comm));
    return e;
}

TRACEPOINT_PROBE(nvme, nvme_setup_cmd)
{
    int qid = args->qid;
    u8 opcode = args->opcode;
    if (qid == 0 && opcode == 0x0c)
        return 0;   /* asynchronous event request: completes only when an event happens */
    u64 id = bpf_get_current_pid_tgid();
    struct kv_nvme_key k = {};
    k.ctrl_id = args->ctrl_id;
    k.qid = qid;
    k.tag = args->cid & 0xfff;
    struct kv_nvme_start s = {};
    s.ts = bpf_ktime_get_ns();
    s.cid = args->cid;
    s.opcode = opcode;
    s.flags = args->flags;
#ifdef KV_NVME_HAVE_FCTYPE
    s.fctype = args->fctype;
#else
    s.fctype = 0xff;       /* this kernel does not say which fabrics command */
#endif
    s.nsid = args->nsid;
    s.setup_tid = (u32)id;
    u32 shift = 9;
    struct kv_nvme_ns *ns = 0;
    if (qid != 0 && kv_nvme_is_lba_cmd(opcode)) {
        u8 cdw[12] = {};
        bpf_probe_read_kernel(cdw, sizeof(cdw), (void *)args->cdw10);
        __builtin_memcpy(&s.slba, cdw, 8);
        s.nlb = ((u32)cdw[8] | ((u32)cdw[9] << 8)) + 1;   /* cdw12[15:0] is 0-based */
        struct kv_nvme_nskey nk = {};
        nk.ctrl_id = k.ctrl_id;
        nk.nsid = s.nsid;
        ns = nvme_ns.lookup(&nk);
        if (ns && ns->lba_shift >= 9 && ns->lba_shift <= 16)
            shift = ns->lba_shift;
        else
            s.xflags |= KV_NVME_X_NS_UNKNOWN;
        if (kv_nvme_moves_data(opcode))
            s.bytes = s.nlb << shift;
    }
#ifdef KV_BLOCKIO_DEFINED
    if (ns) {
        struct kv_block_key bk = {};
        bk.dev = ns->dev1;
        bk.sector = s.slba << (shift - 9);
        struct kv_block_start *b = block_start.lookup(&bk);
        if (!b && ns->dev2) {
            bk.dev = ns->dev2;
            b = block_start.lookup(&bk);
        }
        if (b) {
            s.tgid = b->tgid;
            s.tid = b->tid;
            __builtin_memcpy(s.comm, b->comm, sizeof(s.comm));
            s.issuer = KV_NVME_ISSUER_BLOCK;
        }
    }
#endif
    if (s.issuer == KV_NVME_ISSUER_NONE) {
        s.tgid = id >> 32;
        s.tid = (u32)id;
        bpf_get_current_comm(&s.comm, sizeof(s.comm));
        s.issuer = KV_NVME_ISSUER_SETUP;
    }
    struct kv_nvme_start *prev = nvme_start.lookup(&k);
    if (prev) {
        /* The tag is set up again, so its previous command ended, but the probe did not run
         * for that completion: the kernel skips a tracepoint's BPF program that interrupts
         * another on the same CPU (a completion in softirq on top of a traced syscall).
         * Counted as ended, unseen; always emitted (rare, weight 1). */
        struct kv_nvme_start old = *prev;
        u8 oc = kv_nvme_opclass(qid, old.opcode);
        kv_nvme_count(&k, &old, oc, 0, 0, 0, 0);
        struct kv_nvme_event *e = kv_nvme_event(&k, &old, s.ts, oc, KV_NVME_REC_UNSEEN, 1);
        if (e)
            kv_submit(e, sizeof(*e));
    }
    nvme_start.update(&k, &s);
    struct kv_nvme_qstat *q = kv_nvme_qstat(k.ctrl_id, k.qid, kv_nvme_opclass(qid, opcode));
    if (q)
        __sync_fetch_and_add(&q->setups, 1);
    return 0;
}

/* Emit this completion as an event?  Returns the weight (0: not emitted). */
static __always_inline u32 kv_nvme_sample(u64 now, u64 lat, u16 status, u8 retries)
{
    u32 zero = 0;
    struct kv_nvme_cfg *cfg = nvme_cfg.lookup(&zero);
    u32 mode = cfg ? cfg->mode : KV_NVME_MODE_SAMPLED;
    u32 budget = cfg && cfg->budget ? cfg->budget : 1000;
    u64 slow = cfg ? cfg->slow_ns : 0;
    int forced = status != 0 || retries != 0 || (slow && lat >= slow);
    if (mode == KV_NVME_MODE_ALL)
        return 1;
    struct kv_nvme_rate *r = nvme_rate.lookup(&zero);
    if (!r)
        return forced ? 1 : 0;
    if (now - r->win_start >= KV_NVME_WINDOW_NS) {
        /* the smallest shift that keeps the last window's rate within the budget */
        u32 seen = r->seen, s = 0;
#pragma unroll
        for (int i = 0; i < KV_NVME_MAX_SHIFT; i++) {
            if ((seen >> s) > budget)
                s++;
        }
        r->shift = s;
        r->seen = 0;
        r->win_start = now;
    }
    r->seen++;
    if ((r->seen >> r->shift) > 2 * budget && r->shift < KV_NVME_MAX_SHIFT)
        r->shift++;        /* a burst within the window: sample more sparsely at once */
    if (forced)
        return 1;
    if (mode == KV_NVME_MODE_NONE)
        return 0;
    u32 mask = (1U << r->shift) - 1;
    if ((r->seen & mask) != 0)
        return 0;
    return 1U << r->shift;
}

TRACEPOINT_PROBE(nvme, nvme_complete_rq)
{
    u64 now = bpf_ktime_get_ns();
    struct kv_nvme_key k = {};
    k.ctrl_id = args->ctrl_id;
    k.qid = args->qid;
    k.tag = args->cid & 0xfff;
    struct kv_nvme_start *sp = nvme_start.lookup(&k);
    if (!sp) {
        struct kv_nvme_qstat *u = kv_nvme_qstat(k.ctrl_id, k.qid, KV_NVME_OP_UNKNOWN);
        if (u)
            __sync_fetch_and_add(&u->unmatched, 1);
        return 0;
    }
    struct kv_nvme_start st = *sp;
    nvme_start.delete(&k);
    u64 lat = now - st.ts;
    u16 status = args->status;
    u8 retries = args->retries;
    u8 opclass = kv_nvme_opclass(k.qid, st.opcode);
    kv_nvme_count(&k, &st, opclass, status, retries, lat, 1);

    struct kv_nvme_hkey hk = {};
    hk.ctrl_id = k.ctrl_id;
    hk.qid = k.qid;
    hk.opclass = opclass;
    hk.slot = lat ? bpf_log2l(lat) : 0;   /* bcc's bpf_log2l(v) = floor(log2 v) + 1 */
    u64 hzero = 0;
    u64 *h = nvme_hist.lookup_or_try_init(&hk, &hzero);
    if (h) {
        __sync_fetch_and_add(h, 1);
    } else {
        u32 i = 1;
        u64 *d = nvme_drops.lookup(&i);
        if (d)
            __sync_fetch_and_add(d, 1);
    }

    u32 weight = kv_nvme_sample(now, lat, status, retries);
    if (!weight)
        return 0;
    struct kv_nvme_event *e = kv_nvme_event(&k, &st, now, opclass, KV_NVME_REC_CMD, weight);
    if (!e)
        return 0;
    e->status = status;
    e->flags = args->flags;
    e->retries = retries;
#ifdef KV_NVME_HAVE_DISK
    bpf_probe_read_kernel(e->disk, sizeof(e->disk), (void *)args->disk);
#endif
    kv_submit(e, sizeof(*e));
    return 0;
}

#ifdef KV_NVME_HAVE_SQ
/* PCIe only: at each CQE, how many commands the controller has not fetched yet. */
TRACEPOINT_PROBE(nvme, nvme_sq)
{
    u32 ctrl = args->ctrl_id;
    u32 head = args->sq_head;
    u32 tail = args->sq_tail;
    u32 depth = 65536;
    u32 *qd = nvme_qdepth.lookup(&ctrl);
    if (qd && *qd > 0 && *qd <= 65536)
        depth = *qd;
    u32 occ = (tail + depth - head) % depth;
    struct kv_nvme_qkey ok = {};
    ok.ctrl_id = ctrl;
    ok.qid = args->qid;
    nvme_sqocc.update(&ok, &occ);
    struct kv_nvme_qstat *q = kv_nvme_qstat(ctrl, ok.qid, KV_NVME_OP_QUEUE);
    if (q) {
        __sync_fetch_and_add(&q->sq_samples, 1);
        __sync_fetch_and_add(&q->sq_occ_sum, occ);
        u32 zero = 0;
        struct kv_nvme_cfg *cfg = nvme_cfg.lookup(&zero);
        u32 epoch = cfg ? cfg->epoch : 0;
        if (q->sq_epoch != epoch) {   /* a new flush interval: the peak starts again */
            q->sq_epoch = epoch;
            q->sq_occ_max = occ;
        } else if (occ > q->sq_occ_max) {
            q->sq_occ_max = occ;       /* racy max: good enough for a peak */
        }
    }
    return 0;
}
#endif

#ifdef KV_NVME_HAVE_AEN
/* Asynchronous events: ANA changes, namespace changes, SMART, discovery log changes. */
TRACEPOINT_PROBE(nvme, nvme_async_event)
{
    struct kv_nvme_event *e = events.ringbuf_reserve(sizeof(struct kv_nvme_event));
    if (!e) {
        kv_count_lost(KV_KIND_NVME);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_NVME, sizeof(*e), 0, 0);
    __builtin_memset((char *)e + sizeof(struct kv_hdr), 0, sizeof(*e) - sizeof(struct kv_hdr));
    e->ctrl_id = args->ctrl_id;
    e->result = args->result;
    e->weight = 1;
    e->sq_occ = 0xffff;
    e->rec = KV_NVME_REC_AEN;
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif
