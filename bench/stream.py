"""The request stream of the vLLM benchmarks: one round of the shared-prefix workload, as
bench/overhead.py and bench/attach.py send it to a real server and as bench/hookstep.py
drives a real Scheduler with it (so the hook's cost per step is measured on the same steps
it is charged for).  Standard library and kvtrace.demo.workload only: it runs in vLLM's
interpreter too."""
from __future__ import annotations

from kvtrace.demo import workload

CONCURRENCY = 4   # requests in flight


def requests(short: bool) -> list[workload.Request]:
    """The shared-prefix round of the A/B benchmarks (chunked prefill, prefix hits, evictions)."""
    if short:
        return workload.shared_prefix(seed=5, groups=2, per_group=3, prefix_len=512, suffix_len=256, fillers=1,
                                      filler_len=800, max_tokens=48)
    return workload.shared_prefix(seed=5, groups=4, per_group=4, prefix_len=512, suffix_len=384, fillers=2,
                                  filler_len=1000, max_tokens=64)
