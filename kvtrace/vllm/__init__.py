"""vLLM-side helpers that run in the agent (or tests): the demo server, discovery, native streams."""
