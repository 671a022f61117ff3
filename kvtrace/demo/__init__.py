"""Demo and workload tooling: a real vLLM CPU server with a tiny model, a shared-prefix workload with its own account, built-in I/O workloads with known answers."""
