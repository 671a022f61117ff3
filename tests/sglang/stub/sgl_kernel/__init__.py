"""A stand-in for SGLang's `sgl_kernel` package, for the tests only (never shipped, never used
by kvtrace itself).

SGLang's CPU engine imports `sgl_kernel`, whose registry wheels are CUDA builds; its CPU build is
compiled from SGLang's repository for Xeon with AMX.  With `--attention-backend torch_native`,
SGLang 0.5.23 calls one op of it: `assign_req_to_token_pool_cpu`, which writes each request's
newly allocated KV slots into its row of the request-to-token table.  That op is implemented
here in plain torch.  It replaces a kernel op, not SGLang's scheduler, radix cache or anything
kvtrace traces.  Every other op imports (SGLang's modules import several at load time) and
raises when called, so a run that reaches one fails loudly instead of computing something else.
"""
from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 row_width=None):
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th request's
    slice of out_cache_loc (the slices follow one another).  row_width: the table's row length,
    as SGLang passes it (mem_cache/allocation.py); the slices are bounded by it already."""
    n = len(req_pool_indices)
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for i in range(n):
        k = ends[i] - starts[i]
        req_to_token[rows[i], starts[i]:ends[i]] = out_cache_loc[pos:pos + k].to(req_to_token.dtype)
        pos += k


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in kvtrace's test stand-in (tests/sglang/stub), which "
                                  "implements only assign_req_to_token_pool_cpu; SGLang called an op it does not have")

    op.__name__ = name
    return op


def __getattr__(name: str):
    """Every other op: importable (SGLang's modules import several at load time), raising when called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)


class _Ops:
    """torch.ops.sgl_kernel stand-in for code that reaches ops through sgl_kernel's module."""

    def __getattr__(self, name: str):
        if name == "assign_req_to_token_pool_cpu":
            return assign_req_to_token_pool_cpu
        return _missing(name)


ops = _Ops()
