/* tcp.bpf.c: health of the TCP connections on chosen ports (NVMe/TCP: 4420), whoever owns
 * them (nvme-tcp's sockets are kernel sockets: there is no process to filter on).
 *
 *   tcp:tcp_retransmit_skb     every retransmitted segment
 *   tcp:tcp_retransmit_synack  every retransmitted SYN-ACK of a listener (the final ACK of the
 *                              handshake was lost, or dropped: accept queue full, TCP_DEFER_ACCEPT)
 *   sock:inet_sock_set_state   every state change (connect, close, reset)
 *   tcp:tcp_probe              srtt, cwnd, ssthresh, windows at received segments; one event
 *                              per connection per probe interval, carrying how many probes
 *                              it stands for
 *
 * The ports are a map filled by user space (kvtrace/capture/tcp.py).  Field layouts come from
 * the format files; fields that are not on every kernel are behind KV_TCP_* flags.
 */

#include "kvtrace.h"

#define KV_TCP_RETRANS 1
#define KV_TCP_STATE   2
#define KV_TCP_PROBE   3
#define KV_TCP_SYNACK  4

#define KV_TCP_NEW_SYN_RECV 12   /* a request socket's state (include/net/tcp_states.h) */

struct kv_tcp_event {
    struct kv_hdr h;       /* tgid/tid: the context the event ran in (often softirq) */
    u64 skaddr;            /* the socket (connection id), 0 when the kernel does not give it;
                              SYN-ACK: the listener */
    u64 sock_cookie;
    u32 srtt_us;
    u32 snd_cwnd;
    u32 ssthresh;
    u32 snd_wnd;
    u32 rcv_wnd;
    u32 data_len;
    u32 probes;            /* tcp_probe hits this event stands for */
    s32 err;               /* retransmit: 0 sent, else why not (-EBUSY: still queued, ...); 6.13+ */
    u16 sport;
    u16 dport;
    u16 family;            /* AF_INET 2, AF_INET6 10 */
    u8  type;              /* KV_TCP_* */
    u8  state;             /* retransmit: the socket's state; state change: the old state;
                              SYN-ACK: NEW_SYN_RECV */
    u8  newstate;
    u8  pad[7];
    u8  saddr[16];         /* IPv4 in the first 4 bytes */
    u8  daddr[16];
};

struct kv_tcp_cfg {
    u64 probe_interval_ns;
};

struct kv_tcp_last {
    u64 ts;
    u32 probes;
    u32 pad;
};

BPF_HASH(tcp_ports, u16, u8, 64);
BPF_ARRAY(tcp_cfg, struct kv_tcp_cfg, 1);
BPF_TABLE("lru_hash", u64, struct kv_tcp_last, tcp_last, 16384);

static __always_inline int kv_tcp_port(u16 sport, u16 dport)
{
    return tcp_ports.lookup(&sport) != NULL || tcp_ports.lookup(&dport) != NULL;
}

static __always_inline struct kv_tcp_event *kv_tcp_new(u8 type)
{
    struct kv_tcp_event *e = events.ringbuf_reserve(sizeof(struct kv_tcp_event));
    if (!e) {
        kv_count_lost(KV_KIND_TCP);
        return NULL;
    }
    u64 id = bpf_get_current_pid_tgid();
    kv_fill_hdr(&e->h, KV_KIND_TCP, sizeof(*e), id >> 32, (u32)id);
    __builtin_memset((char *)e + sizeof(struct kv_hdr), 0, sizeof(*e) - sizeof(struct kv_hdr));
    e->type = type;
    return e;
}

/* a new event of a connection on one of our ports (NULL: another port, or the ring is full),
 * addresses from a tracepoint's saddr/daddr (IPv4) or saddr_v6/daddr_v6 */
static __always_inline struct kv_tcp_event *kv_tcp_conn(u8 type, const void *skaddr, u8 state, u16 sport,
                                                        u16 dport, u16 family, const void *s4, const void *d4,
                                                        const void *s6, const void *d6)
{
    if (!kv_tcp_port(sport, dport))
        return NULL;
    struct kv_tcp_event *e = kv_tcp_new(type);
    if (!e)
        return NULL;
    e->skaddr = (u64)skaddr;
    e->state = state;
    e->sport = sport;
    e->dport = dport;
    e->family = family;
    if (family == 10) {
        bpf_probe_read_kernel(e->saddr, 16, s6);
        bpf_probe_read_kernel(e->daddr, 16, d6);
    } else {
        bpf_probe_read_kernel(e->saddr, 4, s4);
        bpf_probe_read_kernel(e->daddr, 4, d4);
    }
    return e;
}

#ifdef KV_TCP_HAVE_RETRANS
#ifdef KV_TCP_RETRANS_FAMILY
#define KV_RETRANS_FAMILY args->family
#else
#define KV_RETRANS_FAMILY 2
#endif
TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    struct kv_tcp_event *e = kv_tcp_conn(KV_TCP_RETRANS, args->skaddr, args->state, args->sport, args->dport,
                                         KV_RETRANS_FAMILY, args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
    if (!e)
        return 0;
#ifdef KV_TCP_RETRANS_ERR
    e->err = args->err;
#endif
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_TCP_HAVE_SYNACK
#ifdef KV_TCP_SYNACK_FAMILY
#define KV_SYNACK_FAMILY args->family
#else
#define KV_SYNACK_FAMILY 2
#endif
TRACEPOINT_PROBE(tcp, tcp_retransmit_synack)
{
    struct kv_tcp_event *e = kv_tcp_conn(KV_TCP_SYNACK, args->skaddr, KV_TCP_NEW_SYN_RECV, args->sport, args->dport,
                                         KV_SYNACK_FAMILY, args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
    if (e)
        kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_TCP_HAVE_STATE
TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != 6)   /* IPPROTO_TCP */
        return 0;
    struct kv_tcp_event *e = kv_tcp_conn(KV_TCP_STATE, args->skaddr, args->oldstate, args->sport, args->dport,
                                         args->family, args->saddr, args->daddr, args->saddr_v6, args->daddr_v6);
    if (!e)
        return 0;
    e->newstate = args->newstate;
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif

#ifdef KV_TCP_HAVE_PROBE
TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u16 sport = args->sport, dport = args->dport;
    if (!kv_tcp_port(sport, dport))
        return 0;
    u64 key = 0;
#if defined(KV_TCP_PROBE_SKADDR)
    key = (u64)args->skaddr;
#elif defined(KV_TCP_PROBE_COOKIE)
    key = args->sock_cookie;
#else
    key = ((u64)sport << 16) | dport;
#endif
    u64 now = bpf_ktime_get_ns();
    u32 zero = 0;
    struct kv_tcp_cfg *cfg = tcp_cfg.lookup(&zero);
    u64 every = cfg && cfg->probe_interval_ns ? cfg->probe_interval_ns : 10000000ULL;
    struct kv_tcp_last *last = tcp_last.lookup(&key);
    u32 probes = 1;
    if (last) {
        if (now - last->ts < every) {
            last->probes++;
            return 0;
        }
        probes = last->probes + 1;
    }
    struct kv_tcp_last nl = {};
    nl.ts = now;
    tcp_last.update(&key, &nl);
    struct kv_tcp_event *e = kv_tcp_new(KV_TCP_PROBE);
    if (!e)
        return 0;
    e->probes = probes;
#ifdef KV_TCP_PROBE_SKADDR
    e->skaddr = (u64)args->skaddr;
#endif
#ifdef KV_TCP_PROBE_COOKIE
    e->sock_cookie = args->sock_cookie;
#endif
    e->srtt_us = args->srtt;
    e->snd_cwnd = args->snd_cwnd;
    e->ssthresh = args->ssthresh;
    e->snd_wnd = args->snd_wnd;
    e->rcv_wnd = args->rcv_wnd;
    e->data_len = args->data_len;
    e->sport = sport;
    e->dport = dport;
    /* the addresses are a sockaddr_in / sockaddr_in6: family first, then port, then address */
    u8 sa[28] = {};
    bpf_probe_read_kernel(sa, sizeof(sa), (void *)args->saddr);
    u16 family = sa[0] | (sa[1] << 8);
    e->family = family;
    if (family == 10) {
        __builtin_memcpy(e->saddr, &sa[8], 16);
        bpf_probe_read_kernel(sa, sizeof(sa), (void *)args->daddr);
        __builtin_memcpy(e->daddr, &sa[8], 16);
    } else {
        __builtin_memcpy(e->saddr, &sa[4], 4);
        bpf_probe_read_kernel(sa, sizeof(sa), (void *)args->daddr);
        __builtin_memcpy(e->daddr, &sa[4], 4);
    }
    kv_submit(e, sizeof(*e));
    return 0;
}
#endif
