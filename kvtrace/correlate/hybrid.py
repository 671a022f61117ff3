"""A hybrid model's KV cache groups in the miss-cause replay (kvtrace.correlate.causes): each
group's cached blocks, and vLLM's hybrid hit rule over them.

vLLM (HybridKVCacheCoordinator.find_longest_cache_hit) looks a prompt up in each group's cache
with that group's rule, and the shortest match wins:
  full attention       every block of the prefix, from the first (the replay's own `present`
                       is the first full-attention group's cache: the reference)
  sliding window       the last cdiv(window - 1, block) blocks before the hit, all cached; right
                       to left from the full-attention match; or, with no such run, the blocks
                       cached from the first on
  mamba                the block just before the hit (its state), right to left
Groups of one spec are looked up together (a block counts where every one of them caches it).
Another kind of group (chunked local attention, cross attention) does not limit the hit here.
The hit is then a multiple of the match unit (`align`: larger than a block where the groups'
block sizes differ).

Full attention caches every full block a request computes.  A sliding-window or Mamba group
caches what its retention keeps (vLLM's prefix_cache_retention_interval, the kv_group rows'
`retention`): -1 every block; 0 (vLLM's default since sparse retention) only the `need` blocks
before each point a later hit can stop at: the prompt's end (its last token is computed again)
and a shared-prefix junction (an admission whose full-attention match the other group cut: the
junction is that match's end, so the next request with that prefix hits); k > 0 also the last
`need` blocks of every k tokens.  A hit adds nothing; each group evicts on its own (the hook's
evict rows carry the group).  Rules are read at the groups' block size when it equals the hash
block (the common case, Gemma's); with larger group blocks only the match unit is applied.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

FULL = "full_attention"
WINDOW = "sliding_window"
MAMBA = "mamba"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    kind: str
    block_size: int
    window: int
    align: int
    hash_block: int
    retention: int = -1

    def need(self, bs: int) -> int:
        """Cached blocks a hit needs before it in this group."""
        if self.kind == WINDOW and self.window > 0:
            return max(-(-(self.window - 1) // bs), 1)
        return 1

    def keeps(self, i: int, bs: int, prompt_len: int, junction: int) -> bool:
        """Whether this group caches block i of a request computing it (its retention)."""
        if self.kind not in (WINDOW, MAMBA) or self.retention < 0 or self.block_size != bs:
            return True
        need, align = self.need(bs), self.align or bs
        if self.retention > 0:
            per = self.retention // bs
            if need >= per or i % per >= per - need:
                return True
        for b in (prompt_len - 1, junction):
            end = b // align * align // bs if b > 0 else 0
            if end - need <= i < end:
                return True
        return False


@dataclass
class Hybrid:
    specs: dict = field(default_factory=dict)                   # group -> GroupSpec
    present: dict = field(default_factory=lambda: defaultdict(set))   # group -> hashes cached
    snapped: set = field(default_factory=set)                   # groups whose snapshot came
    requests: dict = field(default_factory=dict)                # request -> (prompt_len, junction)

    def group(self, r: dict) -> "Hybrid":
        ret = r.get("retention")
        self.specs[int(r["group"])] = GroupSpec(str(r["kind"]), int(r["block_size"]), int(r["window"] or 0),
                                                int(r["align"] or 0), int(r["hash_block"] or 0),
                                                -1 if ret is None else int(ret))
        return self

    @property
    def active(self) -> bool:
        return len(self.specs) > 1

    @property
    def ref(self) -> int:
        """The reference group: the first full-attention one (else the first)."""
        full = [g for g, s in sorted(self.specs.items()) if s.kind == FULL]
        return full[0] if full else min(self.specs, default=0)

    def kind(self, g: int) -> str:
        s = self.specs.get(g)
        return s.kind if s else ""

    def snapshot(self, g: int, first: int, hashes) -> None:
        if g not in self.snapped:
            self.snapped.add(g)
            self.present[g] = set()
        self.present[g].update(int(h) for h in hashes)

    def admit(self, r: str, prompt_len: int, cut: tuple | None, hit: int) -> None:
        """An admission: its prompt, and the junction its cut hit pins (Hybrid.cut's full)."""
        full = cut[0] if cut else 0
        self.requests[r] = (prompt_len, full if full > hit else 0)

    def computed(self, r: str, i: int, h: int, bs: int) -> None:
        """Block i (hash h) of request r computed: each group caches it as its retention says."""
        prompt_len, junction = self.requests.get(r, (0, 0))
        for g, s in self.specs.items():
            if s.keeps(i, bs, prompt_len, junction):
                self.present[g].add(h)

    def leave(self, r: str) -> None:
        self.requests.pop(r, None)

    def evict(self, g: int, h: int) -> None:
        self.present[g].discard(h)

    def cut(self, chain: dict, top_blocks: int, bs: int) -> tuple[int, int, int, int, int]:
        """(full, ruled, group, aligned, unit_top) in tokens for a prompt of ``top_blocks``
        hittable blocks: what full attention alone would hit, what the other groups' rules leave
        of it (and the group that cut it), that rounded down to the match unit, and the most the
        match unit lets hit at all."""
        sets = self._sets()
        full = _prefix(chain, top_blocks, [self.present[g] for g in sets.get((FULL, 0), ())]) \
            if (FULL, 0) in sets else top_blocks
        ruled, group = full, -1
        for _ in range(len(sets) + 1):   # vLLM's fixed point: a cut may shorten another group's match
            changed = False
            for (kind, window), gids in sets.items():
                if kind == FULL:
                    continue
                n = _rule(self.specs[gids[0]], bs, chain, ruled, [self.present[g] for g in gids])
                if n < ruled:
                    ruled, group, changed = n, gids[0], True
            if not changed:
                break
        align = max((s.align for s in self.specs.values()), default=bs) or bs
        tok_full, tok_ruled = full * bs, ruled * bs
        return tok_full, tok_ruled, max(group, 0), tok_ruled - tok_ruled % align, top_blocks * bs - top_blocks * bs % align

    def _sets(self) -> dict:
        """Groups looked up together: (kind, window) -> group ids (full attention: (FULL, 0))."""
        out: dict = {}
        for g, s in sorted(self.specs.items()):
            out.setdefault((s.kind, 0 if s.kind == FULL else s.window), []).append(g)
        return out


def _held(h, sets: list) -> bool:
    return h is not None and all(h in p for p in sets)


def _prefix(chain: dict, top: int, sets: list) -> int:
    n = 0
    while n < top and _held(chain.get(n), sets):
        n += 1
    return n


def _rule(spec: GroupSpec, bs: int, chain: dict, upto: int, sets: list) -> int:
    """Blocks a group of this kind lets hit, of the first ``upto``."""
    if spec.block_size != bs:
        return upto
    if spec.kind == MAMBA:
        return next((i + 1 for i in range(upto - 1, -1, -1) if _held(chain.get(i), sets)), 0)
    if spec.kind != WINDOW or spec.window <= 0:
        return upto
    need = spec.need(bs)
    run = 0
    for i in range(upto - 1, -1, -1):
        if _held(chain.get(i), sets):
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run
