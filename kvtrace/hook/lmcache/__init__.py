"""The hook inside LMCache's multiprocess server (kvtrace.hook.lmcache.hook)."""
