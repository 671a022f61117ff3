"""The workload `kvtrace whatif` replays (read.workload reads it from a dataset): per request its
arrival, prompt as a chain of block hashes, output length, who it waited for (a closed-loop
client) and its place in the recorded order of first admissions, with its state in a replay;
the server kind recorded, the recorded figures, the step-duration model, the storage model and
the recorded steps' own times."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace.analysis.whatif.lmcache import TierModel
from kvtrace.analysis.whatif.storage import StorageModel


@dataclass
class Req:
    rid: str
    arrival: int
    prompt_len: int
    output: int
    chain: list                     # hashes of recorded-size blocks
    after: int = -1                 # index of the request whose finish triggers it (closed loop)
    gap: int = 0
    rank: int = -1                  # its place in the recorded order of first admissions (-1: unknown)
    engine: int = 0                 # the engine (pid) that served it in the recording
    finished_at: int = 0            # when it finished in the recording (0: not known)
    # replay state
    keys: list = field(default_factory=list)
    num_tokens: int = 0
    computed: int = 0
    generated: int = 0
    attempt: int = 0
    admitted: bool = False
    distinct: bool = True           # no key twice in the prompt (so no block twice in blocks)
    done_ns: int = 0
    first_token_ns: int = 0
    arrived_ns: int = 0
    # its pages in the block pool: the blocks it holds, the leading ones hashed
    blocks: list = field(default_factory=list)
    hashed: int = 0
    # in the radix tree: the node its path ends in, the pages on that path, its slots not in the tree
    node: object = None
    held: int = 0
    priv: int = 0


@dataclass
class Workload:
    reqs: list
    block_size: int
    recorded: dict
    model: tuple                    # the step model (a, b, c): recorded.fit_steps
    notes: list
    storage: StorageModel = field(default_factory=StorageModel)
    clock: list | None = None       # the recorded steps' times, in order (recorded.clock); None: not known
    hits: dict = field(default_factory=dict)   # request -> blocks it hit at its first admission, as recorded
    passes_before: int | None = None           # SGLang's pass count at the attach (radix.passes_before)
    kind: str = field(kw_only=True)            # the server kind recorded (kvtrace.servers.registry)
    tier: TierModel = field(default_factory=TierModel, kw_only=True)   # the recorded LMCache tier, if any
    groups: dict = field(default_factory=dict, kw_only=True)   # KV cache group -> GroupSpec (kv_group rows)

    def distinct(self) -> dict:
        """id(chain) -> whether the chain has no hash twice (computed once for every replay)."""
        if getattr(self, "_distinct", None) is None:
            self._distinct = {id(r.chain): len(set(r.chain)) == len(r.chain) for r in self.reqs}
        return self._distinct
