"""The part of kvtrace that runs inside vLLM (EngineCore and Worker processes).

Standard library only: it runs in vLLM's own interpreter, which need not have kvtrace
(or bcc) installed; the agent can load it from a path.  It never raises into vLLM, never
blocks, keeps bounded memory and counts what it drops.
"""
