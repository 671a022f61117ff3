"""The wiring of a capture: which processes, the probes' source, decoding, correlation and the sinks, the vLLM hook and streams, the status line; `kvtrace attach` calls run()."""
