"""The hook inside SGLang's scheduler process.  The module injection loads and the plugin
installs is kvtrace.hook.sglang.hook."""
