"""The kinds of server kvtrace attaches to, one place each (kvtrace.servers.registry): how their
processes are found and described, and what each kind's hook, metrics and cache model are.
Shared here: discovery's process walk, the Python environment read through /proc/PID/root,
the KV-event stream and /metrics.  docs/design.md, "Server kinds"."""
