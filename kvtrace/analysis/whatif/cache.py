"""CacheModel: what the replay's driver (driver.Replay) asks of a server kind's KV cache, and of
the rules the kind's scheduler applies to it.  One model per ServerKind.cache_model
(models.MODELS): the block pool (blockpool.BlockPool, vLLM) and the radix tree
(radix.RadixCache, SGLang).  The cache is counted in pages of ``--block-size`` tokens (a block,
or SGLang's page); a model's counts go into the replay's ``stats`` (evictions, lookups,
recomputed_tokens, storage_loads).

What differs between kinds in reading a recording and sizing a replay is here too: when a finish
is recorded (``finish_lag``), the blocks no request gets (``null_blocks``), where the recorded
cache size comes from (``capacity``, ``free_seen``), what admission reserves
(``new_token_ratio``), the memory a cache takes (``bytes_for``).
"""
from __future__ import annotations

import pyarrow as pa


class CacheModel:
    name = ""            # its key in models.MODELS (ServerKind.cache_model)
    about = ""           # a line above the terminal table (str.format of the recorded figures)
    finish_lag = 0       # steps from the step that finished a request to the step of its finish record
    null_blocks = 0      # blocks of the engine's cache size that no request ever gets
    free_seen = ""       # where the recorded size comes from when /metrics does not say
    chunked = None       # a request whose prefill the next step continues before any other

    def __init__(self, drv, tier: str = "none"):
        """A cache of drv.N pages of drv.B tokens; UsageError for a setting it cannot replay."""
        self.B, self.N, self.stats = drv.B, drv.N, drv.stats

    # -- the recording ----------------------------------------------------------------------

    @classmethod
    def capacity(cls, samples: pa.Table, prefix: str) -> tuple[int | None, str]:
        """The recorded cache size in pages from the scraped /metrics ``samples`` of a kind whose
        series start with ``prefix`` (None: not scraped), and the series it is read from."""
        return None, ""

    @classmethod
    def new_token_ratio(cls, samples: pa.Table, prefix: str) -> float | None:
        """The share of a running request's remaining output its engine reserves room for at
        admission, as recorded (None: the engine reserves by no ratio)."""
        return None

    @staticmethod
    def bytes_for(cache_blocks: int) -> int:
        """The most memory the model's arrays of a cache of cache_blocks take, whatever the workload."""
        return 0

    # -- the scheduler's rules, once per step (each may change drv.running, waiting, batch) --

    def continuing(self, drv) -> int:
        """The running requests' next tokens into drv.batch, preempting (drv.requeue) as the
        engine does when they do not fit; the chunk budget left for admissions (0: none)."""
        raise NotImplementedError

    def admit(self, drv, r, budget: int) -> tuple[int, int] | None:
        """The (local, storage) pages r starts with, held, and r.computed set to them; None, and
        nothing held, when r does not fit."""
        raise NotImplementedError

    def formed(self, drv) -> None:
        """The step's batch complete: allocate for it, or form another batch when it has none."""
        raise NotImplementedError

    def start(self, reqs: list) -> None:
        """Each request's cache state, fresh, before the replay."""

    def computed(self, r) -> None:
        """r's computed tokens just advanced."""

    def finished(self, r) -> None:
        """r ended: its pages let go."""
        self.free(r)

    # -- the cache ------------------------------------------------------------------------------

    def match(self, r) -> int:
        """The pages of r's prompt found cached, from its start, at most those below its
        length - 1, as the engine matches them at admission."""
        raise NotImplementedError

    def alloc(self, r, tokens: int) -> bool:
        """Room for r's tokens below ``tokens``, evicting as the engine does; False, nothing
        taken, when there is none."""
        raise NotImplementedError

    def free(self, r) -> None:
        """r lets go of its pages (a preemption, or at the end of a request)."""
        raise NotImplementedError

    def free_capacity(self) -> int:
        """The pages an allocation can have now, free or evictable."""
        raise NotImplementedError

    def snapshot(self) -> dict:
        """What the cache holds now: pages cached, pages requests hold, free_capacity()."""
        raise NotImplementedError
