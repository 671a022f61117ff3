"""LMCache as the replay's storage tier (``--storage-tier lmcache[:L1_GB][@L2_READ_GBPS[/LATENCY_US]]``,
docs/analysis.md, "An LMCache tier"), and its costs fitted to the recorded tier.

LMCache stores whole chunks of ``chunk_tokens`` (its --chunk-size: the recorded tiers row, 256 by
default), a multiple of the replay's block size: a chunk is stored once its last block is computed
(a partial last chunk never is), into L1 (memory, LRU, L1_GB GiB, else the recorded
--l1-size-gb, else unbounded) and L2 (disk, unbounded).  At admission LMCache's lookup counts
the request's consecutive stored chunks from its first token; vLLM loads the blocks of them past
its own prefix hit (at most ``(tokens - 1) // block``).  A loaded chunk in L1 costs the retrieve
(L1 -> the engine) of its loaded tokens; one only in L2 also costs the read of the whole chunk
(disk -> L1: L2_READ_GBPS, or the recorded read per token) and enters L1.

The recorded costs come from the tier server's own operations (tier_op, the hook in LMCache's
server): per token, its retrieves' time over their tokens and its L2 reads' time over theirs (an
L2 read names whole chunks: its keys x chunk_tokens).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvtrace.analysis import load
from kvtrace.analysis.whatif.tier import TierSpec
from kvtrace.errors import UsageError

DEFAULT_CHUNK_TOKENS = 256   # LMCache's --chunk-size when the tiers table does not say


@dataclass
class TierModel:
    """The recorded LMCache tier: its chunk, its L1 size, and what each hop cost per token."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    l1_bytes: int = 0             # the recorded --l1-size-gb in bytes; 0: not known (unbounded)
    token_bytes: float = 0.0      # KV bytes of one token
    retrieve_ns: float = 0.0      # per token: L1 -> the engine
    l2_read_ns: float = 0.0       # per token: disk -> L1
    retrieves: int = 0
    l2_reads: int = 0
    recorded: bool = False        # the dataset has the tier's records

    def spec(self) -> str:
        """The recorded setting as --storage-tier writes it."""
        return f"lmcache:{self.l1_bytes / (1 << 30):g}" if self.l1_bytes else "lmcache"

    def to_json(self) -> dict:
        return {"chunk_tokens": self.chunk_tokens, "l1_bytes": self.l1_bytes, "token_bytes": self.token_bytes,
                "retrieve_ns_per_token": round(self.retrieve_ns, 1), "l2_read_ns_per_token": round(self.l2_read_ns, 1),
                "fitted_on_retrieves": self.retrieves, "fitted_on_l2_reads": self.l2_reads}


def fit(inp: load.Inputs, block_bytes: int, block_size: int) -> TierModel:
    """The tier model of the recorded run; ``block_bytes`` / ``block_size`` size a token when the
    tier's own records do not."""
    m = TierModel()
    if inp.has("tiers"):
        t = load.read_table(inp, "tiers")
        ct = [c for c in t["chunk_tokens"].to_pylist() if c] if "chunk_tokens" in t.column_names else []
        mem = [c for c in t["memory_bytes"].to_pylist() if c] if "memory_bytes" in t.column_names else []
        m.chunk_tokens = max(ct) if ct else m.chunk_tokens
        m.l1_bytes = max(mem) if mem else 0
        m.recorded = t.num_rows > 0
    token_bytes = []
    if inp.has("tier_op"):
        op = load.read_table(inp, "tier_op")
        m.recorded = m.recorded or op.num_rows > 0
        name = np.array(op["op"].to_pylist(), dtype=object)
        ns = op["t_end_ns"].to_numpy().astype(np.float64) - op["t_start_ns"].to_numpy().astype(np.float64)
        tok = op["num_tokens"].to_numpy().astype(np.float64)
        if "keys" in op.column_names:   # an L2 read counts keys (whole chunks), not tokens
            keys = op["keys"].to_numpy().astype(np.float64)
            tok = np.where((tok == 0) & (name == "l2_read"), keys * m.chunk_tokens, tok)
        nb = op["nbytes"].to_numpy().astype(np.float64)
        for o, field, count in (("retrieve", "retrieve_ns", "retrieves"), ("l2_read", "l2_read_ns", "l2_reads")):
            sel = (name == o) & (tok > 0)
            if sel.any():
                setattr(m, field, float(ns[sel].sum() / tok[sel].sum()))
                setattr(m, count, int(sel.sum()))
                if nb[sel].sum() > 0:
                    token_bytes.append(float(nb[sel].sum() / tok[sel].sum()))
    # an L2 read's bytes are the chunk files' (a retrieve's carry its transfer's framing too)
    m.token_bytes = token_bytes[-1] if token_bytes else (block_bytes / block_size if block_bytes and block_size else 0.0)
    return m


class LmcacheTier:
    """L1 (chunk keys, LRU, at most ``l1_cap`` chunks) over L2 (every chunk stored); a chunk is
    named by the key of its last block."""

    on = True

    def __init__(self, name: str, spec: TierSpec, model: TierModel, block: int, stats: dict):
        ct = model.chunk_tokens
        if ct % block:
            raise UsageError(f"--storage-tier {name}: LMCache's chunk of {ct} tokens is not a multiple of the block "
                             f"size {block}; give a --block-size that divides it")
        self.name, self.m, self.block = name, ct // block, block
        chunk_bytes = ct * model.token_bytes
        l1 = spec.size if spec.size is not None else model.l1_bytes
        if (spec.gbps is not None or spec.size is not None) and not chunk_bytes:
            raise UsageError(f"--storage-tier {name}: the dataset records no KV bytes per token to size LMCache's "
                             "chunks by; record a run with a KV connector, or give lmcache without a size or speed")
        self.l1_cap = int(l1 // chunk_bytes) if l1 and chunk_bytes else None
        if spec.gbps is not None:
            self.l2_chunk_ns = (spec.latency_us or 0.0) * 1e3 + chunk_bytes / spec.gbps
        else:
            self.l2_chunk_ns = (spec.latency_us * 1e3 if spec.latency_us is not None else 0.0) + model.l2_read_ns * ct
        self.retrieve_ns = model.retrieve_ns * block    # per block loaded
        self.l1: OrderedDict = OrderedDict()
        self.l2: set = set()
        self.stats = stats
        stats.update(tier_l1_chunks=0, tier_l2_chunks=0, tier_l1_evictions=0)

    def _l1_put(self, key) -> None:
        self.l1[key] = None
        self.l1.move_to_end(key)
        if self.l1_cap is not None and len(self.l1) > self.l1_cap:
            self.l1.popitem(last=False)
            self.stats["tier_l1_evictions"] += 1

    def computed(self, keys: list, j: int) -> None:
        """Block j computed: the chunk it completes is stored in L1 and L2."""
        if (j + 1) % self.m == 0:
            self.l2.add(keys[j])
            self._l1_put(keys[j])

    def lookup(self, keys: list, hit: int, limit: int) -> int:
        """Blocks past the ``hit`` cached ones that LMCache's consecutive chunks from the first
        token cover, up to block ``limit``."""
        m, c, l1, l2 = self.m, 0, self.l1, self.l2
        while (c + 1) * m <= len(keys) and (keys[(c + 1) * m - 1] in l1 or keys[(c + 1) * m - 1] in l2):
            c += 1
        return max(min(c * m, limit) - hit, 0)

    def load(self, keys: list, hit: int, ext: int) -> float:
        """Load blocks [hit, hit + ext) chunk by chunk: what the admission waits (ns)."""
        m, ns = self.m, 0.0
        for q in range(hit // m, (hit + ext - 1) // m + 1):
            k = keys[(q + 1) * m - 1]
            if k in self.l1:
                self.l1.move_to_end(k)
                self.stats["tier_l1_chunks"] += 1
            else:
                ns += self.l2_chunk_ns
                self.stats["tier_l2_chunks"] += 1
                self._l1_put(k)
            ns += (min((q + 1) * m, hit + ext) - max(q * m, hit)) * self.retrieve_ns
        return ns
