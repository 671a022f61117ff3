"""Why each prompt token missed: the prefix cache replayed from the hook's records, step by step,
and every token of every admission given exactly one cause (docs/analysis.md, "Miss causes").

The replay keeps, per engine, which block hashes are in the prefix cache (the snapshot the hook
sent when this capture began, then every block a chunk completes, every hit, every eviction),
which running requests are still computing which blocks, and when and by whom each block was
evicted.  At each admission, in vLLM's own order within a step (finished and preempted requests
leave, running requests allocate, then each admission looks up and allocates), the tokens of the
prompt (or of the prefill after a preemption) are split:

  hit_local, hit_external      what vLLM found (its own admission record)
  miss_tail                    tokens past the last block vLLM can hit: the partial last block,
                               or the whole last block when the prompt ends on a block boundary
                               (vLLM always computes the last token)
  miss_not_looked_up           everything else, when the request skipped the prefix cache
  per missed full block, by its own state at the lookup:
    miss_inflight              not cached yet, but a running request admitted earlier is computing it
    miss_evicted               stored, then evicted before this admission (when, by whose
                               allocation, and how many evictions and seconds before)
    miss_other_key             never stored under this key, but the same tokens at the same place
                               are cached under another key (LoRA, cache_salt, multimodal)
    miss_other_engine          not in this engine's cache (it would be miss_cold, miss_unseen or
                               miss_evicted), but cached at that moment in another engine of the
                               run (a data-parallel rank of the server; same hash: vLLM's sha256
                               block hashes are the same in every process)
    miss_tier_partial          with a KV tier that stores whole chunks only (LMCache: its tiers
                               row's chunk_tokens): no longer in the device cache (it would be
                               miss_evicted, miss_unseen or miss_other_key), and every request
                               that computed the block had it in its last, partial tier chunk, so
                               the tier never stored it
    miss_group                 a hybrid model (several KV cache groups: kv_group rows): cached for
                               full attention, but another group's rule cut the hit there (a
                               sliding window's last blocks, a Mamba state: vLLM's hybrid hit
                               rule); `group` names the group
    miss_match_unit            cached, or past the last hittable unit, but below the hit's
                               alignment (a hybrid model's match unit larger than a block)
    miss_spec_dropped          the block just past the hit, cached, that vLLM dropped from the hit
                               because the engine's drafter is EAGLE-style (its kv_group rows'
                               `eagle`: the draft model needs that block's last token computed)
    miss_cold                  never stored, and the cache's whole history is known
    miss_unseen                not seen stored in this run, and the server had served before the
                               agent attached (it may have been stored and evicted then), or removed
                               in a way the hook does not see (a prefix-cache reset)
  Cold against unseen is decided by the snapshot at the attach: the run's first.  The hook sends
  another whenever another agent arrives on the host (it cannot tell one tracing this server
  from one tracing other processes); such a later snapshot says how the cache stood then, not
  before the run, and is ignored (docs/hook.md, "The cache snapshot").
  a block that is cached but follows a missed one (vLLM's lookup stops at the first miss) takes
  the cause of the first missed block.

The causes of one admission sum to its prefill length exactly.  Pure Python over the recorded
rows (no root, no bcc); the live correlator feeds one CacheReplay pass by pass, offline one pass
holds the whole run.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field

from kvtrace.correlate.hybrid import Hybrid
from kvtrace.servers import registry

CAUSES = ("hit_local", "hit_external", "miss_cold", "miss_unseen", "miss_evicted", "miss_inflight", "miss_tail",
          "miss_other_key", "miss_not_looked_up", "miss_tier_partial", "miss_other_engine", "miss_group",
          "miss_match_unit", "miss_spec_dropped")
HITS = ("hit_local", "hit_external")
MISSES = CAUSES[2:]
_BREAK = "break"
# what the device cache no longer holds, which a whole-chunk tier would have served had it stored it
_TIER_WOULD_SERVE = ("miss_evicted", "miss_unseen", "miss_other_key")
# what another engine's cache would have served had the request been sent there
_OTHER_ENGINE_WOULD_SERVE = ("miss_cold", "miss_unseen", "miss_evicted")
KEEP = 100_000   # requests whose segments are kept for their later chunks (live: a bound; finished ones go)


@dataclass(slots=True)
class Segment:
    """Tokens [start, end) of one admission with one cause (an evicted block: its own segment)."""

    engine_pid: int
    request: str
    attempt: int
    step: int
    start: int
    end: int
    cause: str
    block_hash: int = 0          # the (first) block of the segment, when it is one block's
    evict_ns: int = 0            # miss_evicted: when it was evicted
    evicted_by: str = ""         # miss_evicted: whose allocation evicted it
    distance_blocks: int = 0     # miss_evicted: evictions from it to this admission, it included
    distance_ns: int = 0         # miss_evicted: from its eviction to this admission's step start
    computing: str = ""          # miss_inflight: the running request computing it
    other_engine: int = 0        # miss_other_engine: an engine (pid) that held it
    group: int = 0               # miss_group: the KV cache group whose rule cut the hit
    elsewhere: int = 0           # the admission's longest cached prefix in another engine of the run (tokens)


@dataclass
class _Engine:
    block_size: int = 0
    fresh: bool | None = None
    snapshot_ns: int | None = None   # the snapshot at the attach (the run's first): it alone decides fresh
    radix: bool = False     # SGLang's radix cache: a step's chunks are matchable only after it
    present: set = field(default_factory=set)
    plain_of: dict = field(default_factory=dict)       # cached hash -> its hash without extra keys
    present_plain: Counter = field(default_factory=Counter)
    stored: set = field(default_factory=set)            # stored at some point of the run
    evicted: dict = field(default_factory=dict)         # hash -> (t_ns, by request, eviction number)
    evictions: int = 0
    pending: dict = field(default_factory=lambda: defaultdict(set))   # hash -> requests computing it
    running: dict = field(default_factory=dict)         # request -> [attempt, progress, pending hashes]
    chains: dict = field(default_factory=dict)          # request -> {index: hash}
    plains: dict = field(default_factory=dict)          # request -> {index: hash without extra keys}
    lookups: dict = field(default_factory=dict)         # request -> {attempt: (skipped, keyed)}
    tier_chunk: int = 0                                 # tokens per chunk of a whole-chunk KV tier (0: none)
    tier_held: set = field(default_factory=set)         # computed in some request's whole tier chunk
    tier_partial: set = field(default_factory=set)      # computed only in requests' partial last tier chunks
    hybrid: "Hybrid | None" = None                      # several KV cache groups (kvtrace.correlate.hybrid)
    eagle: bool = False                                 # vLLM drops the last matched block (EAGLE drafter)


class CacheReplay:
    """The replay of every engine's prefix cache; feed() it the rows of the steps now final, in
    any split over passes: it keeps what later steps need."""

    def __init__(self):
        self.engines: dict[int, _Engine] = defaultdict(_Engine)
        self.segments: list[Segment] = []     # made by the latest feed()
        self.kept: OrderedDict = OrderedDict()  # (pid, request) -> {attempt: its segments}, for its chunks
        self.finished: list = []    # (pid, request) finished in the latest feed(): dropped at the next
        self.tier_chunk = 0         # the run's KV tier's tokens per chunk (its tiers rows), 0: no such tier

    # -- per-request structure: prompt chains, lookups, the snapshot at attach -----------------

    def structure(self, prompt_blocks=(), resume_blocks=(), prompt_plain=(), lookup=(), cached=(), engine=(),
                  tiers=(), kv_group=(), cached_in=()) -> None:
        sizes = {int(r["chunk_tokens"]) for r in tiers if r.get("chunk_tokens")}
        if len(sizes) == 1:   # the run's tier (attach follows the engines' KV-transfer config to it)
            self.tier_chunk = sizes.pop()
        for r in engine:   # a radix tree (SGLang's) holds a chunk from the next step on
            self.engines[r["pid"]].radix = registry.kind(r["name"]).cache_model == "radix"
        for r in kv_group:
            e = self.engines[r["pid"]]
            e.hybrid = (e.hybrid or Hybrid()).group(r)
            e.eagle = e.eagle or bool(r.get("eagle"))
        for r in prompt_blocks:
            e = self.engines[r["pid"]]
            e.block_size = e.block_size or int(r["block_size"])
            _put(e.chains, r["request"], r["first"], r["hashes"])
        for r in resume_blocks:
            _put(self.engines[r["pid"]].chains, r["request"], r["first"], r["hashes"])
        for r in prompt_plain:
            _put(self.engines[r["pid"]].plains, r["request"], r["first"], r["hashes"])
        for r in lookup:
            self.engines[r["pid"]].lookups.setdefault(r["request"], {})[int(r["attempt"])] = (bool(r["skipped"]),
                                                                                             bool(r["keyed"]))
        for r in sorted(cached, key=_snap_time):
            e = self.engines[r["pid"]]
            t = _snap_time(r)
            if e.snapshot_ns is None:
                e.snapshot_ns = t
            elif t != e.snapshot_ns:
                continue   # a later snapshot (another agent's attach): the run's first decided
            if r["first"] == 0:
                e.fresh = {0: True, 1: False}.get(int(r["served"]))
            for h in r["hashes"]:
                _store(e, int(h), int(h))
        for r in cached_in:   # with several groups: each group's share of the snapshot at attach
            e = self.engines[r["pid"]]
            if e.hybrid is not None and _snap_time(r) == e.snapshot_ns:
                e.hybrid.snapshot(int(r["group"]), r["first"], r["hashes"])
                if int(r["group"]) == e.hybrid.ref and int(r["first"]) + len(r["hashes"]) >= int(r["total"]):
                    _keep_only(e, e.hybrid.present[e.hybrid.ref])   # the reference group's own share

    def set_fresh(self, pid: int, fresh: bool) -> None:
        """Whether the engine served no request before the run (when the snapshot cannot say)."""
        e = self.engines[pid]
        if e.fresh is None:
            e.fresh = fresh

    # -- the steps ---------------------------------------------------------------------------

    def feed(self, steps, admits, chunks, evicts, preempts, finishes) -> list[Segment]:
        """Replay these steps (rows as dicts, each with its pid and step); the segments made."""
        self.segments = []
        for key in self.finished:   # their chunks were read (with_chunk_causes) after the feed that saw them finish
            self.kept.pop(key, None)
        self.finished = []
        by_step: dict = defaultdict(lambda: defaultdict(list))
        for kind, rows in (("admit", admits), ("chunk", chunks), ("evict", evicts), ("preempt", preempts),
                           ("finish", finishes)):
            for r in rows:
                by_step[(r["pid"], r["step"])][kind].append(r)
        start_of = {(s["pid"], s["step"]): s["t_start_ns"] for s in steps}
        # in time order across engines (one engine's steps stay in step order): an engine's
        # lookup sees the other engines' caches as they stood then
        for key in sorted(by_step, key=lambda k: (start_of.get(k, 0), k)):
            self._step(key[0], start_of.get(key, 0), by_step[key])
        return self.segments

    def _step(self, pid: int, t_step: int, ev: dict) -> None:
        e = self.engines[pid]
        for p in ev["preempt"]:
            _leave(e, p["request"])
        evicts = defaultdict(list)
        for x in ev["evict"]:
            evicts[x["request"]].append(x)
        scheduled = {c["request"] for c in ev["chunk"]}
        for req in [r for r in evicts if r not in scheduled]:   # decoding requests allocate first
            _evict(e, evicts.pop(req))
        admits = {(a["request"], int(a["attempt"])): a for a in ev["admit"]}
        done = []
        for c in ev["chunk"]:
            r, attempt = c["request"], int(c["attempt"])
            a = admits.pop((r, attempt), None)
            if a is not None:
                self._admit(pid, e, a, t_step)
            _evict(e, evicts.pop(r, ()))
            if e.radix:   # vLLM caches a block at allocation; SGLang inserts a chunk at the next step
                done.append((r, int(c["start"]) + int(c["length"])))
            else:
                _progress(e, r, int(c["start"]) + int(c["length"]))
        for r, upto in done:
            _progress(e, r, upto)
        for a in admits.values():   # an admission without a chunk row (should not happen)
            self._admit(pid, e, a, t_step)
        for rows in evicts.values():
            _evict(e, rows)
        for f in ev["finish"]:   # last: a one-token request finishes in the step of its last chunk
            self._finish(pid, e, f["request"])

    def _finish(self, pid: int, e: _Engine, r: str) -> None:
        """A finished request: nothing of it is needed again but its segments, until its chunks are read."""
        _leave(e, r)
        if e.hybrid is not None:
            e.hybrid.leave(r)
        for d in (e.chains, e.plains, e.lookups):
            d.pop(r, None)
        self.finished.append((pid, r))

    def _admit(self, pid: int, e: _Engine, a: dict, t_step: int) -> None:
        r, attempt = a["request"], int(a["attempt"])
        total = int(a["prefill_len"])
        hit_l, hit_x = int(a["cached_local"]), int(a["cached_external"])
        bs = e.block_size or 1
        e.tier_chunk = e.tier_chunk or self.tier_chunk
        chain = e.chains.get(r, {})
        skipped, keyed = e.lookups.get(r, {}).get(attempt, (False, False))
        segs = [(0, hit_l, "hit_local", {}), (hit_l, hit_l + hit_x, "hit_external", {})]
        hy = None
        best, elsewhere = 0, 0
        if skipped:
            segs.append((hit_l + hit_x, total, "miss_not_looked_up", {}))
        else:
            top = bs * ((total - 1) // bs) if total else 0   # tokens vLLM can hit at most
            best, elsewhere = self._longest_elsewhere(pid, chain, top // bs, bs)
            hy = e.hybrid.cut(chain, top // bs, bs) if e.hybrid is not None and e.hybrid.active else None
            first_cause = None
            for i in range((hit_l + hit_x) // bs, top // bs):
                ruled = _by_rule(hy, i * bs)
                if ruled is None and e.eagle and i * bs == hit_l + hit_x and chain.get(i) in e.present:
                    ruled = ("miss_spec_dropped", {})   # the matched block vLLM gave back
                if ruled is not None:
                    segs.append((i * bs, (i + 1) * bs, *ruled))
                    continue
                cause, detail = self._block(e, r, i, chain.get(i), keyed, t_step)
                if first_cause is None:
                    first_cause = cause if cause != _BREAK else "miss_unseen"
                if cause == _BREAK:
                    cause, detail = first_cause, {}
                other = self._held_elsewhere(pid, chain.get(i), best) if cause in _OTHER_ENGINE_WOULD_SERVE else 0
                if other:
                    cause, detail = "miss_other_engine", {"block_hash": chain[i], "other_engine": other}
                elif cause in _TIER_WOULD_SERVE and chain.get(i) in e.tier_partial:
                    cause, detail = "miss_tier_partial", {"block_hash": chain[i]}
                segs.append((i * bs, (i + 1) * bs, cause, detail))
            segs.append((max(top, hit_l + hit_x), total, "miss_tail", {}))
        self._emit(pid, r, attempt, int(a["step"]), segs, elsewhere)
        if hy is not None:
            e.hybrid.admit(r, total, hy, hit_l + hit_x)
        for i in range((hit_l + hit_x) // bs):   # what hit is cached (loaded blocks too)
            h = chain.get(i)
            if h is not None:
                _store(e, h, _plain(e, r, i, h, keyed))
        pend = [(i, h) for i in range((hit_l + hit_x) // bs, total // bs) if (h := chain.get(i)) is not None]
        e.running[r] = [attempt, hit_l + hit_x, {h for _, h in pend}, keyed, total]
        for _, h in pend:
            e.pending[h].add(r)

    def _block(self, e: _Engine, r: str, i: int, h, keyed: bool, t_step: int) -> tuple[str, dict]:
        """The cause of one missed full block, by its own state at the lookup."""
        if h is None:
            return "miss_unseen", {}
        if h in e.present:
            return _BREAK, {}
        computing = [o for o in e.pending.get(h, ()) if o != r]
        if computing:
            return "miss_inflight", {"block_hash": h, "computing": min(computing)}
        ev = e.evicted.get(h)
        if ev is not None:
            t, by, n = ev
            return "miss_evicted", {"block_hash": h, "evict_ns": t, "evicted_by": by,
                                    "distance_blocks": e.evictions - n, "distance_ns": max(t_step - t, 0)}
        if e.present_plain.get(_plain(e, r, i, h, keyed), 0) > 0:
            return "miss_other_key", {"block_hash": h}
        if h in e.stored or not e.fresh:
            return "miss_unseen", {}
        return "miss_cold", {}

    def _held_elsewhere(self, pid: int, h, prefer: int = 0) -> int:
        """Another engine of the run whose cache holds block h now (its pid; ``prefer`` when it
        does: the one with the longest prefix), else 0."""
        if h is None or len(self.engines) < 2:
            return 0
        if prefer and h in self.engines[prefer].present:
            return prefer
        return next((p for p, o in self.engines.items() if p != pid and h in o.present), 0)

    def _longest_elsewhere(self, pid: int, chain: dict, blocks: int, bs: int) -> tuple[int, int]:
        """(the other engine holding the longest prefix of this chain now, its tokens), or (0, 0):
        what the admission would have hit had it been sent there (the replicas behind a router)."""
        best, n_best = 0, 0
        for p, o in self.engines.items():
            if p == pid or o.block_size != self.engines[pid].block_size:
                continue
            n = 0
            while n < blocks and chain.get(n) in o.present:
                n += 1
            if n > n_best:
                best, n_best = p, n
        return best, n_best * bs

    def chunk_causes(self, pid: int, request: str, attempt: int, start: int, end: int) -> dict[str, int]:
        """Tokens [start, end) of an admission's chunk by miss cause (the misses it computed)."""
        out = dict.fromkeys(MISSES, 0)
        for s in self.kept.get((pid, request), {}).get(attempt, ()):
            if s.cause in out:
                out[s.cause] += max(min(s.end, end) - max(s.start, start), 0)
        return out

    def _emit(self, pid: int, r: str, attempt: int, step: int, segs: list, elsewhere: int = 0) -> None:
        mine = self.kept.setdefault((pid, r), {}).setdefault(attempt, [])
        if len(self.kept) > KEEP:
            self.kept.popitem(last=False)
        self._emit_into(mine, pid, r, attempt, step, segs, self.engines[pid].block_size == 1)
        for seg in mine:
            seg.elsewhere = elsewhere
        self.segments.extend(mine)

    def _emit_into(self, out: list, pid: int, r: str, attempt: int, step: int, segs: list,
                   tokens: bool = False) -> None:
        """``tokens``: a token-granular cache (SGLang's radix tree): consecutive tokens evicted by
        one eviction (same time and request), or computed by one other request, make one segment,
        with its first token's hash and distance."""
        for start, end, cause, detail in segs:
            if end <= start:
                continue
            last = out[-1] if out else None
            if last is not None and last.request == r and last.attempt == attempt and last.cause == cause \
                    and last.end == start and (_same(last, detail) if tokens else
                                               set(detail) <= {"group"} and last.group == detail.get("group", 0)
                                               and not last.evict_ns and not last.computing):
                last.end = end
                continue
            out.append(Segment(pid, r, attempt, step, start, end, cause, **detail))


def _same(last: Segment, detail: dict) -> bool:
    """Whether one more token with this detail continues segment ``last`` (the same eviction, the
    same computing request, or neither)."""
    return (last.evict_ns == detail.get("evict_ns", 0) and last.evicted_by == detail.get("evicted_by", "")
            and last.computing == detail.get("computing", "") and last.other_engine == detail.get("other_engine", 0))


def _snap_time(r: dict) -> int:
    return int(r.get("t_ns") or 0)


def _put(d: dict, request: str, first: int, hashes) -> None:
    chain = d.setdefault(request, {})
    for k, h in enumerate(hashes):
        chain[int(first) + k] = int(h)


def _plain(e: _Engine, r: str, i: int, h: int, keyed: bool) -> int:
    if keyed:
        return e.plains.get(r, {}).get(i, h)
    return h


def _by_rule(hy, tok: int):
    """A hybrid model's block at token ``tok`` that full attention caches but the hit rule cut
    (cause, detail), or None: (full, ruled, group, aligned, unit_top) of Hybrid.cut."""
    if hy is None:
        return None
    full, ruled, group, aligned, unit_top = hy
    if tok >= unit_top or aligned <= tok < ruled:
        return "miss_match_unit", {}
    if ruled <= tok < full:
        return "miss_group", {"group": group}
    return None


def _keep_only(e: _Engine, keep: set) -> None:
    for h in [h for h in e.present if h not in keep]:
        e.present.discard(h)
        p = e.plain_of.pop(h, h)
        e.present_plain[p] -= 1
        if e.present_plain[p] <= 0:
            del e.present_plain[p]


def _store(e: _Engine, h: int, plain: int) -> None:
    if h in e.present:
        return
    e.present.add(h)
    e.stored.add(h)
    e.plain_of[h] = plain
    e.present_plain[plain] += 1
    e.evicted.pop(h, None)


def _evict(e: _Engine, rows) -> None:
    for x in rows:
        h = int(x["block_hash"])
        if e.hybrid is not None and e.hybrid.active:
            g = int(x.get("group") or 0)
            e.hybrid.evict(g, h)
            if g != e.hybrid.ref:   # another group's copy: the reference group still holds the block
                continue
        e.evictions += 1
        e.evicted[h] = (int(x["t_ns"]), x["request"], e.evictions - 1)
        if h in e.present:
            e.present.discard(h)
            p = e.plain_of.pop(h, h)
            e.present_plain[p] -= 1
            if e.present_plain[p] <= 0:
                del e.present_plain[p]


def _progress(e: _Engine, r: str, end: int) -> None:
    """A chunk of r ran to token ``end``: the blocks it completed are cached."""
    run = e.running.get(r)
    if run is None:
        return
    bs = e.block_size or 1
    chain = e.chains.get(r, {})
    whole = e.tier_chunk * (run[4] // e.tier_chunk) if e.tier_chunk else 0   # tokens in r's whole tier chunks
    for i in range(run[1] // bs, end // bs):
        h = chain.get(i)
        if h is not None:
            _store(e, h, _plain(e, r, i, h, run[3]))
            if e.hybrid is not None and e.hybrid.active:
                e.hybrid.computed(r, i, h, bs)
            if e.tier_chunk:
                _tier_computed(e, h, (i + 1) * bs <= whole)
            run[2].discard(h)
            s = e.pending.get(h)
            if s is not None:
                s.discard(r)
                if not s:
                    del e.pending[h]
    run[1] = max(run[1], end)


def _tier_computed(e: _Engine, h: int, whole: bool) -> None:
    """Block h computed, in a whole tier chunk (the tier stores it) or in the partial last one."""
    if whole:
        e.tier_held.add(h)
        e.tier_partial.discard(h)
    elif h not in e.tier_held:
        e.tier_partial.add(h)


def _leave(e: _Engine, r: str) -> None:
    run = e.running.pop(r, None)
    if run is None:
        return
    for h in run[2]:
        s = e.pending.get(h)
        if s is not None:
            s.discard(r)
            if not s:
                del e.pending[h]


def causes_of(segments) -> dict[int, dict[str, int]]:
    """One request's segments: attempt -> tokens per cause (every cause, zeros included)."""
    out: dict = {}
    for s in segments:
        d = out.setdefault(s.attempt, dict.fromkeys(CAUSES, 0))
        d[s.cause] += s.end - s.start
    return out


def table_rows(segments) -> dict[str, list]:
    """The token_causes columns (docs/schema.md) of these segments."""
    cols = {k: [] for k in ("engine_pid", "request", "attempt", "step", "token_start", "token_end", "tokens", "cause",
                            "block_hash", "evict_ns", "evicted_by", "distance_blocks", "distance_ns", "computing",
                            "other_engine", "group", "elsewhere")}
    for s in segments:
        for k, v in (("engine_pid", s.engine_pid), ("request", s.request), ("attempt", s.attempt), ("step", s.step),
                     ("token_start", s.start), ("token_end", s.end), ("tokens", s.end - s.start), ("cause", s.cause),
                     ("block_hash", s.block_hash), ("evict_ns", s.evict_ns), ("evicted_by", s.evicted_by),
                     ("distance_blocks", s.distance_blocks), ("distance_ns", s.distance_ns), ("computing", s.computing),
                     ("other_engine", s.other_engine), ("group", s.group), ("elsewhere", s.elsewhere)):
            cols[k].append(v)
    return cols
