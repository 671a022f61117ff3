"""The hook inside vLLM (its EngineCore and Worker processes) and kvtrace's file KV connector.
The module injection loads and the plugin installs is kvtrace.hook.vllm.hook."""
