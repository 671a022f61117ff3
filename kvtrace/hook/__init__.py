"""The part of kvtrace that runs inside the server's own processes (vLLM's EngineCore and
Workers, SGLang's scheduler).

Standard library only: it runs in the server's interpreter, which need not have kvtrace (or
bcc) installed; the agent stages its files through /proc/PID/root and loads them from checked
bytes (kvtrace.inject).  It never raises into the server, never blocks, keeps bounded memory
and counts what it drops.

Shared by every server kind, here: the records (wire), their transport, the per-process queue
and state, the generated wrappers (exact), the patch registry, the source checks (plan, source)
and the connector API (api).  One package per kind, which imports only these and never the
other kind's: kvtrace.hook.vllm, kvtrace.hook.sglang (docs/hook.md).
"""
